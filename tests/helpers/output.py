"""What gpuforge's own output looks like, to tell it from third-party noise in a run's log."""

import re

# The lines gpuforge itself prints while training (stdout and stderr): its log lines (rich's level column,
# then indented continuations), the progress bar, the closing summary, and the compression table.
OWN_LINE = re.compile(
    r"(DEBUG|INFO|WARNING|ERROR) +\S.*"  # gpuforge's logger
    r"| {9}\S.*"  # a log line's continuation
    r"|step +\d+/\d+ .*"  # the progress bar
    r"|(finished|paused|failed|cancelled) at step \d+/\d+.*"
    r"|(run directory|compressed): \S.*"
    r"| +compressed variants .*| \S.*"  # the compression table's title, header, rule and rows
)
