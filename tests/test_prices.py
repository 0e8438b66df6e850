"""Device prices: an hourly price, or an owned device's cost from its parts; the file's errors name the file
and the entry; the CLI that writes it; a server filling a job's cost.usd_per_hour from it."""

import json

import pytest
import yaml
from fastapi.testclient import TestClient

from gpuforge.errors import SpecError
from gpuforge.prices import DevicePrice, load_prices, price_of, save_prices
from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.cli import run_cli


def test_an_owned_devices_hour_is_its_purchase_over_its_working_hours_plus_its_energy():
    owned = DevicePrice(purchase_usd=30_000, years=4, watts=700, usd_per_kwh=0.15, utilisation=0.6)
    assert owned.parts() == pytest.approx({"purchase": 30_000 / (4 * 8760 * 0.6), "energy": 0.105})
    assert owned.hourly() == pytest.approx(1.4269 + 0.105, abs=1e-4)  # $30,000 over 21,024 working hours
    assert DevicePrice(usd_per_hour=2.5).parts() == {"hourly": 2.5}
    with pytest.raises(ValueError, match="not both"):
        DevicePrice(usd_per_hour=2.5, watts=700)
    with pytest.raises(ValueError, match="needs purchase_usd, years, watts and usd_per_kwh"):
        DevicePrice(purchase_usd=30_000)


def test_the_file_round_trips_and_its_errors_name_the_entry(tmp_path):
    path = tmp_path / "prices.yaml"
    assert load_prices(path) == {}
    save_prices(path, {"cuda": DevicePrice(usd_per_hour=2.5), "NVIDIA H100": DevicePrice(
        purchase_usd=30_000, years=4, watts=700, usd_per_kwh=0.15)})  # fmt: skip
    prices = load_prices(path)
    assert price_of(prices, "NVIDIA H100", "cuda")[0] == "NVIDIA H100"  # by name first
    assert price_of(prices, "NVIDIA A100", "cuda")[0] == "cuda"  # else by kind
    assert price_of(prices, "2 of 2 CPU cores", "cpu") is None
    path.write_text(yaml.safe_dump({"cuda": {"usd_per_hour": -1}}))
    with pytest.raises(SpecError, match=r"prices\.yaml: cuda\.usd_per_hour: .*greater than or equal to 0"):
        load_prices(path)
    path.write_text("- a list")
    with pytest.raises(SpecError, match="a mapping of device -> price"):
        load_prices(path)


@pytest.mark.slow
def test_the_cli_sets_lists_and_removes_prices(tmp_path):
    env = {"GPUFORGE_HOME": str(tmp_path)}
    made = run_cli("prices", "set", "cpu", "--purchase-usd", "3000", "--years", "4", "--watts", "200",
                   "--usd-per-kwh", "0.2", "--utilisation", "0.5", env=env)  # fmt: skip
    assert made.returncode == 0 and "purchase $0.1712, energy $0.0400" in made.stdout, made.stderr
    listed = json.loads(run_cli("prices", "list", "--json", env=env).stdout)
    assert listed["cpu"]["usd_per_hour"] == pytest.approx(0.2112, abs=1e-4) and listed["cpu"]["watts"] == 200
    bad = run_cli("prices", "set", "cuda", "--years", "3", env=env)
    assert bad.returncode == 2 and "needs purchase_usd" in bad.stderr
    assert run_cli("prices", "remove", "cpu", env=env).returncode == 0
    assert json.loads(run_cli("prices", "list", "--json", env=env).stdout) == {}


def test_the_server_fills_a_jobs_hourly_cost_from_its_devices_price(tmp_path):
    home = tmp_path / "home"
    settings = Settings(home=home, db=f"sqlite:///{tmp_path / 'store.db'}", schedule=False)
    spec = {"name": "gpt", "model": {"source": "bundled:gpt-tiny", "task": "causal-lm"},
            "data": {"train": "stdlib:docstrings"}, "train": {"max_steps": 2}}  # fmt: skip
    with TestClient(create_app(settings)) as client:
        auth = {"Authorization": f"Bearer {(home / 'admin.key').read_text().strip()}"}

        def submitted(spec) -> dict:
            answer = client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}, headers=auth)
            assert answer.status_code == 201, answer.text
            return client.get(f"/api/v1/jobs/{answer.json()['id']}/spec", headers=auth).json()["spec"]["cost"]

        assert submitted(spec)["usd_per_hour"] == 0.0  # no prices: untracked, as before
        save_prices(home / "prices.yaml", {"cpu": DevicePrice(purchase_usd=3000, years=4, watts=200,
                                                              usd_per_kwh=0.2, utilisation=0.5)})  # fmt: skip
        cost = submitted(spec)
        assert (
            cost["usd_per_hour"] == pytest.approx(0.2112, abs=1e-4)
            and cost["instance"] == "cpu (prices.yaml)"
        )
        assert submitted({**spec, "cost": {"usd_per_hour": 0.5}})["usd_per_hour"] == 0.5  # the spec's own
        (home / "prices.yaml").write_text("cpu: {usd_per_hour: lots}")
        refused = client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}, headers=auth)
        assert refused.status_code == 503 and "prices.yaml: cpu.usd_per_hour" in refused.json()["detail"]
