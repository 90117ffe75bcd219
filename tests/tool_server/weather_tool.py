"""A tool that calls an outside service, written outside ``tool_server/``: one module and one ``register`` line.
``test_upstream_tool.py`` serves it with ``python -m tool_server --tool-module weather_tool`` in front of a fake
weather service."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tool_server.config import UpstreamLimits
from tool_server.errors import ToolError
from tool_server.tools import BadToolCall, BudgetFlag, UpstreamTool, register


class ForecastRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str


class ForecastTool(UpstreamTool):
    name = "forecast"
    schema = {"type": "function", "function": {
        "name": "forecast", "description": "Tomorrow's weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    arguments = ("city",)
    request_model = ForecastRequest
    argument_words = "the city"
    upstream = "weather"  # its line in /stats and its price key, tools.price_per_1k.weather
    budgets = (BudgetFlag("weather", "max weather service calls this run"),)
    base_url_env = "WEATHER_BASE_URL"
    key_env = "WEATHER_KEY"
    limits = UpstreamLimits(max_attempts=2, attempt_timeout_s=5.0, backoff_base_s=0.01, backoff_max_s=0.02)

    def request(self, arguments: dict) -> dict:
        city = arguments.get("city")
        if not isinstance(city, str) or not city.strip():
            raise BadToolCall("forecast needs 'city': a non-empty string")
        return {"city": city}

    async def call_upstream(self, endpoint, request: ForecastRequest, deadline: float):
        return await endpoint.request("POST", "/forecast", deadline=deadline, json_body={"city": request.city},
                                      headers={"Authorization": f"Bearer {endpoint.key}"})

    def classify(self, response):
        if response.status == 404:  # the service's answer about the city, not a failure of anyone
            return ToolError("no_results", "the weather service knows no such city")
        return super().classify(response)

    def render(self, request: ForecastRequest, response) -> tuple[str, list[dict]]:
        body = response.json()
        forecast = body.get("forecast") if isinstance(body, dict) else None
        if not isinstance(forecast, str):
            raise ToolError("infra", "the weather service's reply has no 'forecast' text", reason="bad_reply")
        return f"The forecast for {request.city}: {forecast}", [{"city": request.city, "forecast": forecast}]


register(ForecastTool())
