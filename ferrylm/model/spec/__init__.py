"""Speculative decoding: proposers (n-gram, draft model, layer skip) and the runner side of a step."""
