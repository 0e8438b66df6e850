"""What one device of a kind costs an hour on this server, from its prices.yaml (gpuforge/prices.py): what
a submit fills a job's cost.usd_per_hour with, and a deploy a replica's rate in the ledger."""

from __future__ import annotations

from fastapi import HTTPException, Request, status

from gpuforge.errors import SpecError
from gpuforge.hardware.catalog import datasheet_for, load_catalog
from gpuforge.prices import load_prices, price_of, prices_path


def device_price(request: Request, device_type: str) -> tuple[str, float] | None:
    """(where the price comes from, USD an hour) of one device of `device_type` here: prices.yaml's entry
    for the first such device's name, else for its kind, else the device catalog's price of its model
    (hardware/catalog.py, with the admin's devices.yaml); None where none prices it (or the server has no
    device of that kind). 503 while the admin's file cannot be read: nothing is priced $0 by a typo."""
    home = request.app.state.settings.home
    try:
        prices = load_prices(prices_path(home))
    except SpecError as err:  # the admin's file, not the user's request
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the server's {err}") from None
    device = next((d for d in request.app.state.devices if d.kind == device_type), None)
    if device is None:
        return None
    found = price_of(prices, device.name, device.kind)
    if found is not None:
        name, price = found
        return f"{name} (prices.yaml)", round(price.hourly(), 6)
    try:
        model = datasheet_for(load_catalog(home), device.name)
    except SpecError as err:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the server's {err}") from None
    if model is None or model.usd_per_hour is None:
        return None
    return f"{model.name} (the device catalog's on-demand price)", round(model.usd_per_hour, 6)
