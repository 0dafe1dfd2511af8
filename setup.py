"""Build script. The package metadata lives in pyproject.toml; C++ extensions (csrc/) are added here."""
from setuptools import setup

setup()
