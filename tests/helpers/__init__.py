"""Helpers shared by the tests (imported by them; no test module imports another): ctypes mirrors
of the ABI structs, the checks the core and the twin are held to, the engine step's stateful
machine, side-by-side fork groups and the memory probes."""
