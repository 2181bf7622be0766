"""Service settings, from the environment (CCE_SERVICE_*, CCE_TUNING_DB_URL) or arguments."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.auth import TokenScopes, parse_token_spec
from tuning_db.engine import DB_URL_ENV


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CCE_SERVICE_", populate_by_name=True, extra="ignore")

    db_url: str | None = Field(
        None,
        validation_alias=DB_URL_ENV,
        description="SQLAlchemy URL; unset = the per-user SQLite file (see tuning_db.engine)",
    )
    tokens: str = Field("", description="'token:scope,scope;token2:scope' with scopes read, write, admin")
    tokens_file: Path | None = Field(None, description="a file in the same format (';' or newlines between tokens)")
    open_reads: bool = Field(False, description="allow reads without a token (writes always need one)")
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="larger request bodies get 413")

    @field_validator("tokens_file", mode="before")
    @classmethod
    def _named_file(cls, value: object) -> object:
        """An empty value is an unset shell variable, not a file: as a Path it was '.', a directory."""
        if isinstance(value, str) and not value.strip():
            raise PydanticCustomError("empty", "is empty; unset it, or name a file of tokens")
        return value

    def token_scopes(self) -> TokenScopes:
        """Every configured token and its scopes; raises ValueError on a malformed entry."""
        spec = self.tokens
        if self.tokens_file is not None:
            # UTF-8 whatever the locale; a byte order mark (Windows editors write one) is no part
            # of the first token, which it made 'not URL-safe characters'
            spec += "\n" + self.tokens_file.read_text(encoding="utf-8-sig")
        return parse_token_spec(spec)
