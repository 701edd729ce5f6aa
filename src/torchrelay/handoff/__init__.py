"""Handoff: pack a stopped run into a verifiable bundle, verify it, and prepare it on another cluster."""
