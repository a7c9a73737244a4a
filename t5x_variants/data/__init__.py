"""Data: vocabularies, corpora, T5 objectives, seqio tasks and mixtures, feature conversion.

The only package that imports TensorFlow, seqio and tensorflow-datasets (all but ``config``, the
gin-bound ``DatasetConfig``, which hosts without them read too).
"""
