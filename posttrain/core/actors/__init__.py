"""The roles of a run, one module each. Every role is a plain class: the local executor instantiates it
in-process, the Ray executor wraps the same class with ``ray.remote``. A role is built from the resolved
run config as plain data and rebuilds its own plugin manager, as every process does."""
