"""A Keras model on the handwritten digits that scikit-learn ships, as a team's own script would be, run by
gpuforge as a script job (keras-digits.yaml beside it). Three lines make it a good citizen:
track.log for the curves, a checkpoint each epoch (and when asked to stop), and a resume from it.

    python keras_digits.py --epochs 5       # by hand: the same script, track does nothing
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from gpuforge import track  # noqa: E402


class Report(keras.callbacks.Callback):
    """Each epoch's figures to gpuforge, a checkpoint after it, and a stop when gpuforge asks."""

    def __init__(self, checkpoint):
        super().__init__()
        self.checkpoint = checkpoint

    def on_train_batch_end(self, batch, logs=None):
        if track.should_stop():  # cancelled, over budget, preempted: end the epoch here and save
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        track.log(
            epoch,
            loss=logs["loss"],
            accuracy=logs["accuracy"],
            eval_loss=logs.get("val_loss", float("nan")),
            eval_accuracy=logs.get("val_accuracy", float("nan")),
        )
        # written aside, then renamed over the last one: a kill mid-write leaves that one whole
        partial = self.checkpoint.with_name("partial-" + self.checkpoint.name)  # Keras wants .keras last
        self.model.save(partial)
        os.replace(partial, self.checkpoint)
        track.checkpointed(epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype("float32"), y[order]
    held = len(x) // 5
    keras.utils.set_random_seed(0)

    checkpoint = track.checkpoint_dir() / "model.keras"
    start = track.resume_step()  # the epoch after the last one checkpointed, or 0
    if start and checkpoint.exists():
        model = keras.models.load_model(checkpoint)
        print(f"resumed from epoch {start - 1}", flush=True)
    else:
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(
        x[held:],
        y[held:],
        batch_size=args.batch_size,
        epochs=args.epochs,
        initial_epoch=start,
        validation_data=(x[:held], y[:held]),
        callbacks=[Report(checkpoint)],
        verbose=2,
    )


if __name__ == "__main__":
    main()
