"""Finds the packages under the one import root `belayer_rl` (the repository's top folder), so a
new folder with an __init__.py is in the wheel without being listed by hand."""

from setuptools import find_packages, setup

SOURCE_FOLDERS = ["cli*", "shared*", "services*"]

setup(packages=["belayer_rl", *(f"belayer_rl.{name}" for name in find_packages(".", include=SOURCE_FOLDERS))])
