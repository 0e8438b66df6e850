"""What a device costs an hour: $GPUFORGE_HOME/prices.yaml, one entry a device (its name as the server
lists it, e.g. "NVIDIA H100 80GB HBM3", or a kind: cuda, cpu).

    cuda: {usd_per_hour: 2.50}                       # rented: the price of the offer
    NVIDIA H100 80GB HBM3:                           # owned: what it costs to have it
      purchase_usd: 30000                            #   bought for
      years: 4                                       #   written off over
      watts: 700                                     #   drawn under load
      usd_per_kwh: 0.15                              #   what the power costs
      utilisation: 0.6                               #   the share of the year it does work

An owned device's hour of work costs its purchase spread over the hours it works in its life, plus the
energy of that hour: purchase / (years x 8760 x utilisation) + watts / 1000 x usd_per_kwh. On premises a
job then costs what it really costs, not $0. The server fills a job's cost.usd_per_hour from here unless
the spec sets it (routes/jobs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuforge.errors import SpecError

HOURS_A_YEAR = 8760.0
PRICES_FILE = "prices.yaml"


class DevicePrice(BaseModel):
    """An hourly price, or the parts of an owned device's cost; not both."""

    model_config = ConfigDict(extra="forbid")

    usd_per_hour: float | None = Field(None, ge=0, le=10_000, description="a rented device's price")
    purchase_usd: float | None = Field(None, ge=0, le=1e8, description="what the device (its share) cost")
    years: float | None = Field(None, gt=0, le=50, description="years it is written off over")
    watts: float | None = Field(None, ge=0, le=100_000, description="power drawn under load")
    usd_per_kwh: float | None = Field(None, ge=0, le=100, description="what the power costs")
    utilisation: float = Field(1.0, gt=0, le=1, description="share of the year it does work")

    @model_validator(mode="after")
    def _one_way(self) -> DevicePrice:
        owned = [self.purchase_usd, self.years, self.watts, self.usd_per_kwh]
        if self.usd_per_hour is not None:
            if any(v is not None for v in owned):
                raise ValueError("either usd_per_hour, or purchase_usd/years/watts/usd_per_kwh: not both")
        elif any(v is None for v in owned):
            raise ValueError(
                "an owned device needs purchase_usd, years, watts and usd_per_kwh (or give usd_per_hour)"
            )
        return self

    def parts(self) -> dict[str, float]:
        """The hourly cost's parts: `hourly` for a price, `purchase` and `energy` for an owned device."""
        if self.usd_per_hour is not None:
            return {"hourly": self.usd_per_hour}
        working_hours = self.years * HOURS_A_YEAR * self.utilisation
        return {"purchase": self.purchase_usd / working_hours, "energy": self.watts / 1000 * self.usd_per_kwh}

    def hourly(self) -> float:
        return sum(self.parts().values())


def prices_path(home: Path) -> Path:
    return Path(home) / PRICES_FILE


def load_prices(path: Path) -> dict[str, DevicePrice]:
    """The prices a file holds ({} when there is none); a SpecError that names the file and the entry."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"{path}: cannot read the prices: {err}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a mapping of device -> price is expected")
    prices = {}
    for name, entry in raw.items():
        try:
            prices[str(name)] = DevicePrice.model_validate(entry)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise SpecError(f"{path}: {name}{'.' + where if where else ''}: {first['msg']}") from None
    return prices


def save_prices(path: Path, prices: dict[str, DevicePrice]) -> None:
    """Write the prices (only the fields each entry set), replacing the file whole."""
    entries: dict[str, Any] = {
        name: price.model_dump(exclude_none=True, exclude_defaults=True) or {"usd_per_hour": 0.0}
        for name, price in sorted(prices.items())
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(entries, sort_keys=False))
    tmp.replace(path)


def price_of(prices: dict[str, DevicePrice], name: str, kind: str) -> tuple[str, DevicePrice] | None:
    """The price of a device: by its name, else by its kind (cuda, cpu); None when neither is priced."""
    for key in (name, kind):
        if key in prices:
            return key, prices[key]
    return None
