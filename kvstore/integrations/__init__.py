"""Integrations of kvstore into serving engines (each loaded by the engine's own plug-in mechanism)."""
