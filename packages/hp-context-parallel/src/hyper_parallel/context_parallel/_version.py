__version__ = "0.3.10.dev1"
