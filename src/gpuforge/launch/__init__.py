"""Starting a job's ranks: local processes (job.py), Ray actors (ray_ranks.py), and the network throttle
used to measure gradient compression on a slow link (throttle.py). Above train/: each rank runs
`python -m gpuforge.train.rank`."""
