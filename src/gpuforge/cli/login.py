"""Single sign-on for the client verbs (they join `gpuforge.cli.app`):

    gpuforge login [--server URL] [--browser]     sign in at the server's OpenID provider
    gpuforge logout [--server URL]                forget that sign-in

`login` asks the server which provider and client id (GET /auth/oidc/config), signs in there with the
device-authorization flow (a code to type in any browser) where the provider offers it, else through a
browser on this machine (a loopback redirect; --browser chooses it anyway), and keeps the tokens in a
0600 file under ~/.config/gpuforge/logins/. The client verbs then present the ID token, refreshed as it
nears its expiry, whenever no API key is given (GPUFORGE_API_KEY, --api-key-file win).
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpuforge.cli.app import app, console

Server = Annotated[str | None, typer.Option("--server", help="server URL (default: $GPUFORGE_URL)")]


def _server(server: str | None) -> str:
    from gpuforge.settings import current

    return (server or current().url).rstrip("/")


def _show(text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)  # a URL is never wrapped


@app.command()
def login(
    server: Server = None,
    browser: Annotated[
        bool,
        typer.Option(
            "--browser", help="sign in through a browser on this machine, even where a code would do"
        ),
    ] = False,
) -> None:
    """Sign in to a server with single sign-on (its OpenID Connect provider); the client verbs then use it."""
    from gpuforge.oidc.login import sign_in

    sign_in(_server(server), show=_show, use_browser=browser)


@app.command()
def logout(server: Server = None) -> None:
    """Forget the sign-in kept for a server."""
    from gpuforge.oidc.login_file import remove_login

    url = _server(server)
    _show(f"signed out of {url}" if remove_login(url) else f"not signed in to {url}")
