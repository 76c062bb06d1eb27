"""``CostFormula``: a cost formula for a step's peak memory in bytes, its variables declared
(the planner core's formula, with a one-line error for a string given as the names), and
``FormulaError``, what a formula that does not parse raises.
"""
from __future__ import annotations

from typing import Optional, Sequence

from . import _planner

FormulaError = _planner.FormulaError


class CostFormula(_planner.CostFormula):
    """A cost formula for a step's peak memory in bytes, e.g. ``a*bs*l^2 + b*bs*l + c``.

    ``CostFormula("a*bs*l + b*bs + c", ["bs", "l"])`` declares the variables; every other name
    is a coefficient (fitted, bytes per unit of its term), or give ``coefficients=[...]``.

    Args:
        text: the formula (``docs/formula.md`` has its grammar).
        variables: the variable names, in the order of every dims row (a list, not a string).
        coefficients: the coefficient names; default every name of ``text`` that is not a variable.
        allow_nonlinear: admit terms nonlinear in a coefficient, such as ``l^p``.

    Attributes:
        text: the formula as given.
        canonical: one spelling for equivalent formulas.
        identity_hash: 16 hex digits of the canonical formula.
        coefficient_names: the coefficients, in order.
        variable_names: the variables, in order.
        is_linear: whether the formula is linear in its coefficients.

    Raises:
        FormulaError: a formula that does not parse or is not allowed (its ``position``,
            ``column`` and ``symbol``).
        TypeError: ``variables`` or ``coefficients`` not a sequence of strings (a string alone:
            one line naming it).
    """

    def __init__(self, text: str, variables: Sequence[str], coefficients: Optional[Sequence[str]] = None,
                 allow_nonlinear: bool = False) -> None:
        for what, names in (("variables", variables), ("coefficients", coefficients)):
            if isinstance(names, str):
                example = [name.strip() for name in names.split(",")]
                raise TypeError(f"CostFormula: {what} must be a list of names, e.g. {example!r}, got the string "
                                f"{names!r}")
        super().__init__(text, variables, coefficients, allow_nonlinear)
