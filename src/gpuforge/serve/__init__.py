"""An endpoint: one trained model (or compressed variant) behind HTTP with dynamic batching, adapters and
metrics. It loads artifacts (artifact/) and runs them (runtime/, weights/); it never imports train/."""
