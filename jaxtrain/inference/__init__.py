"""A trained run used: restore() -> Classifier (classifier.py), and the classifier as a
StableHLO or ONNX file (exporters.py)."""
