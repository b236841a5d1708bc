"""The tutorial's model in plain Keras 3 layers (keras-hub pulls in TensorFlow, so it is not used).

``TokenAndPositionEmbedding`` and ``TransformerDecoder`` mirror keras-hub's layers of the same
names (keras-hub ``keras_hub/src/layers/modeling/token_and_position_embedding.py`` and
``transformer_decoder.py``): same sub-layer names (``token_embedding``, ``position_embedding``,
``self_attention``, ``self_attention_layer_norm``, ``feedforward_intermediate_dense``,
``feedforward_output_dense``, ``feedforward_layer_norm``), post-norm residual blocks, a causal
self-attention mask, layer-norm epsilon 1e-5 and ReLU in the feed-forward network. The decoder
has no cross-attention (the tutorial calls it without an encoder sequence).
"""

from __future__ import annotations

import keras
from keras import ops

PACKAGE = "fp8export_keras_float8"


@keras.saving.register_keras_serializable(package=PACKAGE)
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding (keras-hub semantics)."""

    def __init__(self, vocabulary_size, sequence_length, embedding_dim, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.sequence_length = sequence_length
        self.embedding_dim = embedding_dim
        self.token_embedding = keras.layers.Embedding(
            vocabulary_size, embedding_dim, dtype=self.dtype_policy, name="token_embedding")
        self.position_embedding = keras.layers.Embedding(
            sequence_length, embedding_dim, embeddings_initializer="glorot_uniform",
            dtype=self.dtype_policy, name="position_embedding")

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build((None,))
        self.built = True

    def call(self, inputs):
        positions = ops.arange(ops.shape(inputs)[-1], dtype="int32")
        return self.token_embedding(inputs) + self.position_embedding(positions)[None]

    def get_config(self):
        return {**super().get_config(), "vocabulary_size": self.vocabulary_size,
                "sequence_length": self.sequence_length, "embedding_dim": self.embedding_dim}


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerDecoder(keras.layers.Layer):
    """keras-hub's TransformerDecoder without cross-attention (post-norm, causal)."""

    def __init__(self, intermediate_dim, num_heads, dropout=0.0, layer_norm_epsilon=1e-5,
                 **kwargs):
        super().__init__(**kwargs)
        self.intermediate_dim = intermediate_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon

    def build(self, input_shape):
        hidden_dim = input_shape[-1]
        policy = self.dtype_policy
        self._self_attention_layer = keras.layers.MultiHeadAttention(
            num_heads=self.num_heads, key_dim=hidden_dim // self.num_heads,
            dropout=self.dropout, dtype=policy, name="self_attention")
        self._self_attention_layer.build(input_shape, input_shape)
        self._self_attention_layer_norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="self_attention_layer_norm")
        self._self_attention_layer_norm.build(input_shape)
        self._self_attention_dropout = keras.layers.Dropout(
            self.dropout, dtype=policy, name="self_attention_dropout")
        self._feedforward_intermediate_dense = keras.layers.Dense(
            self.intermediate_dim, activation="relu", dtype=policy,
            name="feedforward_intermediate_dense")
        self._feedforward_intermediate_dense.build(input_shape)
        self._feedforward_output_dense = keras.layers.Dense(
            hidden_dim, dtype=policy, name="feedforward_output_dense")
        self._feedforward_output_dense.build((*input_shape[:-1], self.intermediate_dim))
        self._feedforward_layer_norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="feedforward_layer_norm")
        self._feedforward_layer_norm.build(input_shape)
        self._feedforward_dropout = keras.layers.Dropout(
            self.dropout, dtype=policy, name="feedforward_dropout")
        self.built = True

    def call(self, x, training=None):
        residual = x
        x = self._self_attention_layer(query=x, value=x, use_causal_mask=True, training=training)
        x = self._self_attention_dropout(x, training=training)
        x = self._self_attention_layer_norm(x + residual)
        residual = x
        x = self._feedforward_intermediate_dense(x)
        x = self._feedforward_output_dense(x)
        x = self._feedforward_dropout(x, training=training)
        return self._feedforward_layer_norm(x + residual)

    def get_config(self):
        return {**super().get_config(), "intermediate_dim": self.intermediate_dim,
                "num_heads": self.num_heads, "dropout": self.dropout,
                "layer_norm_epsilon": self.layer_norm_epsilon}


def build_model(vocabulary_size=20000, max_sequence_length=200, hidden_dim=32, num_heads=2,
                intermediate_dim=32, dropout=0.1):
    """The tutorial's ``build_model``, layer for layer."""
    token_id_input = keras.layers.Input(shape=(None,), dtype="int32", name="input_ids")
    x = TokenAndPositionEmbedding(vocabulary_size=vocabulary_size,
                                  sequence_length=max_sequence_length,
                                  embedding_dim=hidden_dim)(token_id_input)
    x = keras.layers.Dropout(rate=dropout)(x)
    x = TransformerDecoder(intermediate_dim=intermediate_dim, num_heads=num_heads,
                           dropout=dropout)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Dense(intermediate_dim, activation="relu")(x)
    x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs=token_id_input, outputs=outputs)
