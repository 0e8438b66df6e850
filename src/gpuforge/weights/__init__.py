"""Operations on a model's weights that training, compression, loading and serving share: post-training
quantization and its layers, a QLoRA base, merging an adapter, the shapes of channel-pruned layers.

Nothing here trains or measures: compress/ decides what to apply and reports on it, serve/ applies
quantization at load, artifact/ rebuilds what a manifest describes."""
