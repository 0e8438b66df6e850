"""What test modules share besides fixtures: paths, spec writers, a CLI runner, process and run helpers.

tests/conftest.py holds only hooks and fixtures; a test imports a helper from here, never from conftest or
from another test module, so collecting one test file never depends on another."""
