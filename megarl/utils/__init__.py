"""Small dependency-free helpers every megarl package may import (see docs/ARCHITECTURE.md)."""
