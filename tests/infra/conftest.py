"""The operator's own servers (tests/infra/own_servers.py) for the tests here."""

from tests.infra.own_servers import own_servers as own_servers
