"""What one device of a kind costs an hour on this server, from its prices.yaml (gpuforge/prices.py): what
a submit fills a job's cost.usd_per_hour with, and a deploy a replica's rate in the ledger."""

from __future__ import annotations

from fastapi import HTTPException, Request, status

from gpuforge.errors import SpecError
from gpuforge.prices import load_prices, price_of, prices_path


def device_price(request: Request, device_type: str) -> tuple[str, float] | None:
    """(the prices.yaml entry, USD an hour) of one device of `device_type` here: by the name of the first
    such device, else by its kind; None where neither is priced (or the server has none of that kind).
    503 while the admin's file cannot be read: nothing is priced $0 by a typo."""
    try:
        prices = load_prices(prices_path(request.app.state.settings.home))
    except SpecError as err:  # the admin's file, not the user's request
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the server's {err}") from None
    device = next((d for d in request.app.state.devices if d.kind == device_type), None)
    found = price_of(prices, device.name, device.kind) if device is not None else None
    if found is None:
        return None
    name, price = found
    return name, round(price.hourly(), 6)
