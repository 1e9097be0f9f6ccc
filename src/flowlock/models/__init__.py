"""Strict model paths built from flowlock ops."""
