__version__ = "0.3.4.dev5"
