"""What one device costs an hour on this server, from its prices.yaml (gpuforge/prices.py): what a submit
fills a job's cost.usd_per_hour with, a deploy a replica's rate in the ledger, and what the devices page
and `gpuforge prices list` show.

A rate of 0 is no price: the spec's own convention (cost.usd_per_hour 0 means not tracked), and what the
ledger charges an unpriced job or replica. Every answer that shows such a figure says "no price set" and
the command that sets one (SET_PRICE), never $0."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fastapi import HTTPException, Request, status

from gpuforge.errors import SpecError
from gpuforge.hardware.catalog import datasheet_for, load_catalog
from gpuforge.prices import DevicePrice, load_prices, price_of, prices_path
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.server.services import services

# where to run it: the server reads its own home's prices.yaml at each submit and deploy
SET_PRICE = "gpuforge prices set {kind} --usd-per-hour N (on the server's machine, with its GPUFORGE_HOME)"


@dataclass(frozen=True)
class Price:
    source: str  # "cpu (prices.yaml)", "H100 SXM (the device catalog's on-demand price)"
    usd_per_hour: float
    # an owned device's: what a kWh costs, and the part of usd_per_hour that is its nominal energy (watts
    # x usd_per_kwh), which a job's rate leaves out since the ledger charges the kWh it measures instead
    usd_per_kwh: float | None = None
    energy_usd_per_hour: float = 0.0


def set_price_command(kind: str) -> str:
    return SET_PRICE.format(kind=kind)


def shown_price(price: Price | None, kind: str) -> tuple[float | None, str | None, str | None]:
    """(USD an hour, where it comes from, the command that sets one) as the devices and prices answers
    show a device's price: the first two null, the third given, where none is set."""
    if price is None:
        return None, None, set_price_command(kind)
    return price.usd_per_hour, price.source, None


def server_prices(home: Path) -> dict[str, DevicePrice]:
    """The server's prices.yaml; 503 while it cannot be read: nothing is priced $0 by a typo."""
    try:
        return load_prices(prices_path(home))
    except SpecError as err:  # the admin's file, not the user's request
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the server's {err}") from None


def prices_of(home: Path, devices: Iterable[DeviceInfo]) -> dict[str, Price | None]:
    """device id -> its price: prices.yaml's entry for its name, else for its kind, else the device
    catalog's price of its model (hardware/catalog.py, with the admin's devices.yaml); None where none
    prices it (or prices it 0)."""
    prices = server_prices(home)
    catalog = None
    answer: dict[str, Price | None] = {}
    for device in devices:
        found = price_of(prices, device.name, device.kind)
        if found is not None:
            name, price = found
            priced = _priced(f"{name} (prices.yaml)", price.hourly())
            if priced is not None and price.usd_per_kwh is not None:
                energy = price.parts().get("energy", 0.0)
                priced = Price(priced.source, priced.usd_per_hour, price.usd_per_kwh, energy)
            answer[device.id] = priced
            continue
        if catalog is None:
            try:
                catalog = load_catalog(home)
            except SpecError as err:
                raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the server's {err}") from None
        model = datasheet_for(catalog, device.name)
        usd = None if model is None else model.usd_per_hour
        answer[device.id] = (
            _priced(f"{model.name} (the device catalog's on-demand price)", usd) if usd else None
        )
    return answer


def _priced(source: str, usd: float | None) -> Price | None:
    return Price(source, round(usd, 6)) if usd else None


def device_price(request: Request, device_type: str) -> tuple[str, float] | None:
    """(where the price comes from, USD an hour) of one device of `device_type` here: the first such
    device's price (prices_of); None where none prices it (or the server has no device of that kind)."""
    device = next((d for d in services(request).devices if d.kind == device_type), None)
    if device is None:
        return None
    found = prices_of(services(request).settings.home, [device])[device.id]
    return None if found is None else (found.source, found.usd_per_hour)
