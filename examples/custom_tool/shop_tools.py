"""Two user-defined tools for a shopping task: the file to copy when you write your own tools.

`price_of` is a plain typed function made a tool with `@tool`: its schema comes from the
signature and docstring. Its hidden `prices` parameter (excluded from the schema, so the
model never sees it) is filled per dataset row from `tools_kwargs.price_of.execute_kwargs`.

`CartTool` needs state per trajectory and a reward, so it subclasses `BaseTool` and uses
the whole lifecycle, each step with its own per-row kwargs from `tools_kwargs.add_to_cart`:

    create(instance_id, **create_kwargs)            -> a new, empty cart with this row's stock
    execute(instance_id, {"item", "quantity"})      -> put items in the cart (or say why not)
    calc_reward(instance_id, **calc_reward_kwargs)  -> how well the cart matches this row's order
    release(instance_id, **release_kwargs)          -> drop the cart (always called, also after errors)

One tool object serves every concurrent trajectory: keep state keyed by `instance_id`.
"""

from __future__ import annotations

import logging
from typing import Any

from verl_agent.tools import BaseTool, ToolResponse, tool

logger = logging.getLogger(__name__)


@tool(exclude=("prices",))
def price_of(item: str, prices: dict[str, float] | None = None) -> str:
    """Look up the price of one item in the shop.

    Args:
        item: The item's name, e.g. "apple".
    """
    price = (prices or {}).get(item.strip().lower().rstrip("s"))
    return f"{item}: ${price:.2f} each" if price is not None else f"{item}: not sold here"


class CartTool(BaseTool):
    """add_to_cart(item, quantity): one cart per trajectory, rewarded for matching the requested order."""

    def __init__(self, config: dict[str, Any], tool_schema: Any = None):
        super().__init__(config, tool_schema)
        self.max_quantity = int(self.config.get("max_quantity", 10))
        self.carts: dict[str, dict[str, Any]] = {}  # instance_id -> {"stock": {...}, "items": {...}}

    async def create(self, instance_id: str | None = None, stock: dict[str, int] | None = None, **kwargs: Any) -> str:
        instance_id = await super().create(instance_id)
        self.carts[instance_id] = {"stock": dict(stock or {}), "items": {}}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        cart = self.carts[instance_id]
        item, qty = parameters["item"].strip().lower().rstrip("s"), int(parameters["quantity"])
        have = cart["stock"].get(item, 0) - cart["items"].get(item, 0)
        if qty < 1 or qty > self.max_quantity:
            return ToolResponse(text=f"Error: quantity must be 1..{self.max_quantity}"), 0.0, {"ok": False}
        if qty > have:
            return ToolResponse(text=f"Only {have} {item} left in stock."), 0.0, {"ok": False}
        cart["items"][item] = cart["items"].get(item, 0) + qty
        summary = ", ".join(f"{n} {k}" for k, n in sorted(cart["items"].items()))
        return ToolResponse(text=f"Added {qty} {item}. Cart: {summary}."), 0.0, {"ok": True}

    async def calc_reward(self, instance_id: str, order: dict[str, int] | None = None, **kwargs: Any) -> float:
        """Share of order lines matched exactly; items that were not ordered count against it."""
        items, order = self.carts[instance_id]["items"], dict(order or {})
        if not order:
            return 0.0
        right = sum(items.get(k) == n for k, n in order.items())
        return right / max(len(order), len(set(items) | set(order)))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        cart = self.carts.pop(instance_id, None)
        logger.debug("released cart %s: %s", instance_id, cart and cart["items"])
