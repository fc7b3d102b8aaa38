"""The ``iop`` command line: run the API, the workers, a whole local system, and tools."""
