"""Integrations with other libraries' capture-time behaviour (see cuda_graph/decisions.py)."""
