"""What the machine has (probe) and how fast it really is (bench)."""
