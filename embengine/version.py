"""embengine's version (also in pyproject.toml). A module of its own so that modules inside the
package (checkpoint, serving) can record it without importing the package's ``__init__``."""

__version__ = "0.1.0"
