"""Roles: this rank's stage of one model with its optimizer (see role.py)."""
