__version__ = "0.3.2.dev2"
