"""Tuning: search spaces (space), the tuned registry (registry), one trial (objective) and the
`attngen tune` command (tune)."""
