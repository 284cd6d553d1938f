"""Torch modules for the supported model families and their weight loading."""
