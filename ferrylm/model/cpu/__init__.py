"""CPU: instruction-set detection, the plan per machine, threads, and the C++ kernel builds."""
