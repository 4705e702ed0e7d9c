"""Pooling models (embeddings, classification, scores): how a sequence's hidden states become
one vector (poolers.py) and how a model directory says which pooler it was trained with
(model_config.py)."""
