__version__ = "0.1.2.dev1"
