"""Single sign-on with an OpenID Connect provider: what both the server and the CLI need of it.

- http.py: bounded HTTP to the provider (timeouts, size caps, https but for loopback);
- issuer.py: its discovery document and signing keys, cached, refetched once on a new key id;
- verify.py: `IdTokenVerifier.verify_id_token(token, nonce)` -> `Claims`, or `TokenRefused(reason)`;
- flows.py: the authorization-code flow with PKCE, refresh, the device-authorization flow;
- loopback.py, login.py: `gpuforge login`'s redirect receiver and sign-in;
- login_file.py, session.py: the CLI's kept sign-in (0600) and the bearer auth that refreshes it.

The server's routes are server/oidc.py. Nothing here knows the server's users: it ends at verified
claims (sub, name, email, groups).
"""
