"""The bundled calibration and held-out evaluation text (see SOURCES.md)."""
