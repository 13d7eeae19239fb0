"""Tenants' key spaces and encryption at rest."""
