"""Helpers shared by the tests (imported by them; no test module imports another): ctypes mirrors
of the ABI structs and step capsules over ctypes callbacks (``ctypes_abi``), the checks the core
and the twin are held to and state snapshots (``step_checks``, ``facade_checks``), the engine
step's stateful machine (``step_machine``), fork groups side by side and integer stand-ins
(``groups``), and the memory probes (``memory``)."""
