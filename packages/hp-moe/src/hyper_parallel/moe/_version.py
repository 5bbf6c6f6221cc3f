__version__ = "0.1.3.dev3"
