"""Routing across replicas: the registry of upstream FerryLM servers, their health, the policies
that pick one per request, and the streaming proxy (`ferrylm gateway`)."""
