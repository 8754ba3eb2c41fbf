"""Final-answer extraction and equivalence checking for math rewards.

Pipeline: ``extract_*`` pulls a candidate answer string out of a model response,
``normalize_answer`` strips LaTeX presentation (``$``, ``\\left``, ``\\text{}``
units, ``\\dfrac``, degrees, thousands separators, ...), and ``is_equiv`` decides
whether two normalized answers mean the same thing:

* plain string equality (case-insensitive for words),
* multiple-choice letters (``\\text{(A)}`` == ``A``),
* variable assignments (``x = 3`` == ``3``) and equations side by side,
* tuples / intervals element-wise in order with matching brackets, sets
  (``\\{...\\}``) and bare comma lists as unordered multisets, unions of
  intervals as unordered,
* numbers: decimals, fractions (``1/2``, ``\\frac12``, ``\\frac{1}{2}``), mixed
  numbers, percentages (``50\\%`` equals both ``50`` and ``0.5``),
* symbolic expressions through sympy when it is importable (``\\sqrt``,
  ``\\pi``, powers, implicit multiplication); sympy parsing runs only on a
  whitelisted character/identifier set and refuses huge powers, so model output
  is never evaluated as arbitrary Python and cannot hang the grader with
  ``9^{9^{9^9}}``.
"""

from __future__ import annotations

import keyword
import math
import random
import re
import threading
from fractions import Fraction
from typing import Any, Optional

# sympy (an optional dependency) is imported at the first answer that needs it: ~0.5 CPU s that every rollout
# process paid at start-up, also in runs whose rewards never grade math.
_sympy: Any = None
_sympy_tried = False
_sympy_lock = threading.Lock()  # batched rewards grade on several threads: none may see "tried" before the module


def _load_sympy() -> Any:
    """The sympy module, or None without it."""
    global _sympy, _sympy_tried
    if not _sympy_tried:
        with _sympy_lock:
            if not _sympy_tried:
                try:
                    import sympy
                except Exception:  # pragma: no cover - exercised only without sympy
                    sympy = None
                _sympy = sympy
                _sympy_tried = True
    return _sympy

__all__ = [
    "extract_boxed",
    "last_boxed_only_string",
    "extract_answer_is",
    "extract_last_number",
    "extract_math_answer",
    "normalize_answer",
    "is_equiv",
    "grade_answer",
    "sympy_available",
]

REL_TOL = 1e-9  # for values computed in floating point (irrational constants)
ABS_TOL = 1e-9


def sympy_available() -> bool:
    return _load_sympy() is not None


from relax.rollout.rewards.math_extract import (  # noqa: F401  (re-exported)
    _match_brace,
    _last_box_cmd,
    last_boxed_only_string,
    extract_boxed,
    _ANSWER_IS_RE,
    extract_answer_is,
    _NUMBER_RE,
    extract_last_number,
    extract_math_answer,
)

# --------------------------------------------------------------------------- normalization

_TEXT_CMDS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mbox", "operatorname", "textnormal", "mathit")
_UNIT_WORDS = {
    "unit", "units", "cm", "mm", "m", "km", "meter", "meters", "metre", "metres", "centimeter",
    "centimeters", "kilometer", "kilometers", "inch", "inches", "in", "ft", "foot", "feet", "yard",
    "yards", "mile", "miles", "mph", "sq", "square", "cubic", "degree", "degrees", "dollar", "dollars",
    "cent", "cents", "second", "seconds", "sec", "s", "minute", "minutes", "min", "hour", "hours", "hr",
    "day", "days", "week", "weeks", "month", "months", "year", "years", "g", "kg", "gram", "grams",
    "pound", "pounds", "lb", "lbs", "ounce", "ounces", "oz", "liter", "liters", "l", "ml", "gallon",
    "gallons", "percent", "people", "students", "points", "ways", "times", "radians", "rad",
}


def _replace_text_commands(s: str) -> str:
    """Unwrap ``\\text{...}``-like commands; a trailing word-only one after a value is a unit."""
    pattern = re.compile(r"\\(" + "|".join(_TEXT_CMDS) + r")\s*\{")
    while True:
        m = pattern.search(s)
        if not m:
            return s
        open_idx = m.end() - 1
        close = _match_brace(s, open_idx)
        if close < 0:
            return s
        content = s[open_idx + 1 : close]
        before, after = s[: m.start()], s[close + 1 :]
        word = content.strip()
        if (
            before.strip()
            and not after.strip()
            and re.fullmatch(r"[A-Za-z][A-Za-z\s.\-]*(\^\{?\d\}?)?", word)
            and word.lower() not in ("and", "or")
        ):
            s = before  # unit after a value: drop it
        elif word.lower() in ("and", "or") and before.strip() and after.strip():
            s = before + "," + after
        else:
            s = before + content + after


def _strip_wrappers(s: str) -> str:
    s = s.strip()
    changed = True
    while changed:
        changed = False
        for a, b in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
                s = s[len(a) : len(s) - len(b)].strip()
                changed = True
    return s


def normalize_answer(answer: Any) -> str:
    """Canonical string form of a final answer (presentation-only changes)."""
    if answer is None:
        return ""
    s = str(answer).strip()
    s = _strip_wrappers(s)
    inner = extract_boxed(s)
    if inner is not None:
        s = inner
    s = s.replace("\n", " ").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:d|t)frac", r"\\frac", s)
    s = re.sub(r"\\left\s*\.|\\right\s*\.", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:displaystyle|textstyle)(?![A-Za-z])", "", s)
    # thousands separators written in LaTeX: 1{,}000  1\,000  1\!000
    s = re.sub(r"(?<=\d)\{,\}(?=\d{3})", "", s)
    s = re.sub(r"(?<=\d)\\[,!;: ](?=\d{3})", "", s)
    s = re.sub(r"\\(?:qquad|quad)(?![A-Za-z])|\\[,!;: ]|~", " ", s)
    # degrees
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree(?![A-Za-z])", "", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\\(?:mathbb|mathcal)\s*\{\s*R\s*\}", "R", s)
    s = _replace_text_commands(s)
    s = s.strip()
    # trailing plain unit words after a value ("5 cm", "12 square feet")
    while True:
        m = re.fullmatch(r"(.*?[\d})\]a-zA-Z])\s+([A-Za-z]+)\.?", s)
        if m and m.group(2).lower() in _UNIT_WORDS and re.search(r"[\d}]", m.group(1)):
            s = m.group(1).strip()
            continue
        break
    s = s.strip()
    s = re.sub(r"\.$", "", s).strip()
    s = re.sub(r"\\(?:,|!|;|:)", "", s)
    s = re.sub(r"\s+", " ", s)
    # whole-string number with thousands separators
    compact = s.replace(" ", "")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", compact):
        s = compact.replace(",", "")
    # canonical spacing: drop spaces (keep single spaces between words)
    s = re.sub(r"(?<=[^A-Za-z])\s+|\s+(?=[^A-Za-z])", "", s)
    s = s.strip()
    # \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    return s


# --------------------------------------------------------------------------- structure

_OPEN = "([{"
_CLOSE = ")]}"


def _split_top(s: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` at bracket depth 0 (all of ()[]{} count, and \\{ \\})."""
    parts, depth, cur = [], 0, []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            cur.append(s[i : i + 2])
            i += 2
            continue
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        if depth == 0 and s.startswith(sep, i):
            parts.append("".join(cur))
            cur = []
            i += len(sep)
            continue
        cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _wraps_whole(s: str) -> bool:
    """True when the bracket opened at s[0] closes at s[-1]."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return False
    depth = 0
    for i, c in enumerate(s):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return False
    return depth == 0


def _structure(s: str) -> tuple:
    """('union', parts) | ('set', elems) | ('seq', open, close, elems) | ('list', elems) | ('scalar', s)."""
    if "\\cup" in s:
        parts = [p for p in (x.strip() for x in s.split("\\cup")) if p]
        if len(parts) > 1:
            return ("union", parts)
    if s.startswith("\\{") and s.endswith("\\}"):
        return ("set", [e.strip() for e in _split_top(s[2:-2]) if e.strip()])
    if _wraps_whole(s):
        inner = s[1:-1]
        elems = _split_top(inner)
        if len(elems) > 1:
            return ("seq", s[0], s[-1], [e.strip() for e in elems])
    elems = _split_top(s)
    if len(elems) > 1 and all(e.strip() for e in elems):
        return ("list", [e.strip() for e in elems])
    return ("scalar", s)


def _multiset_match(a: list[str], b: list[str]) -> bool:
    if len(a) != len(b):
        return False
    remaining = list(b)
    for x in a:
        for j, y in enumerate(remaining):
            if _equiv_norm(x, y):
                del remaining[j]
                break
        else:
            return False
    return True


# --------------------------------------------------------------------------- scalar compare

_NUM_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _parse_number(s: str) -> Optional[Fraction | float]:
    s = s.strip()
    neg = False
    if s.startswith("-"):
        neg, s = True, s[1:].strip()
    elif s.startswith("+"):
        s = s[1:].strip()
    if s.startswith("(") and s.endswith(")") and _wraps_whole(s):
        inner = _parse_number(s[1:-1])
        return None if inner is None else (-inner if neg else inner)
    val: Optional[Fraction | float] = None
    if _NUM_RE.fullmatch(s):
        try:
            val = Fraction(s)
        except (ValueError, ZeroDivisionError):
            try:
                val = float(s)
            except ValueError:
                return None
    else:
        m = re.fullmatch(r"(\d+)?\\frac\{\s*(-?\s*[\d.]+)\s*\}\{\s*(-?\s*[\d.]+)\s*\}", s)
        if m is None:
            m2 = re.fullmatch(r"(-?[\d.]+)\s*/\s*(-?[\d.]+)", s)
            if m2 is None:
                return None
            whole, num, den = None, m2.group(1), m2.group(2)
        else:
            whole, num, den = m.group(1), m.group(2), m.group(3)
        try:
            n, d = Fraction(num.replace(" ", "")), Fraction(den.replace(" ", ""))
            if d == 0:
                return None
            val = n / d
            if whole is not None:  # mixed number 2\frac{1}{2}
                val = Fraction(whole) + val
        except (ValueError, ZeroDivisionError):
            return None
    if val is None:
        return None
    return -val if neg else val


def _close(a: complex | float, b: complex | float) -> bool:
    try:
        return abs(a - b) <= max(ABS_TOL, REL_TOL * max(abs(a), abs(b)))
    except (TypeError, OverflowError):
        return False


def _number_candidates(s: str) -> Optional[list]:
    """Numeric values of ``s``; a percentage gives both p and p/100."""
    if s.endswith("%"):
        v = _parse_number(s[:-1])
        return None if v is None else [v, Fraction(v) / 100 if isinstance(v, Fraction) else v / 100]
    v = _parse_number(s)
    return None if v is None else [v]


_DECIMAL_RE = re.compile(r"[-+]?(\d*)\.(\d+)")
MIN_ROUNDED_SIG_DIGITS = 6


def _rounds_to(decimal_str: str, value: Any) -> bool:
    """A decimal answer with >= 6 significant digits matches a value that rounds to it
    (``0.333333`` matches 1/3, ``3.14159`` matches pi; ``0.33`` matches neither)."""
    m = _DECIMAL_RE.fullmatch(decimal_str.strip())
    if not m:
        return False
    digits = (m.group(1) + m.group(2)).lstrip("0")
    if len(digits) < MIN_ROUNDED_SIG_DIGITS:
        return False
    try:
        v = complex(value)
    except (TypeError, ValueError, OverflowError):
        return False
    if abs(v.imag) > ABS_TOL:
        return False
    k = len(m.group(2))
    return abs(v.real - float(Fraction(decimal_str.strip()))) <= 0.5 * 10 ** (-k) * (1 + 1e-9)


def _exact_value(expr) -> Optional[Fraction]:
    """An exact rational value of a constant sympy expression, else None."""
    try:
        v = expr.doit()
        if isinstance(v, _sympy.Rational):
            return Fraction(int(v.p), int(v.q))
    except Exception:
        pass
    return None


def _scalar_equiv(a: str, b: str) -> bool:
    if a == b:
        return True
    na, nb = _number_candidates(a), _number_candidates(b)
    if na is not None and nb is not None:
        # numbers written out are exact rationals: compare exactly, or by the rounding rule
        if any(x == y for x in na for y in nb):
            return True
        return _rounds_to(a, nb[0]) or _rounds_to(b, na[0])
    # percentages on one side with an expression on the other
    a_ = a[:-1] if a.endswith("%") else a
    b_ = b[:-1] if b.endswith("%") else b
    if _load_sympy() is None:
        return a_ == b_
    ea, eb = _to_sympy(a_), _to_sympy(b_)
    if ea is None or eb is None:
        return a_ == b_
    if a.endswith("%") != b.endswith("%"):
        pct, other = (ea, eb) if a.endswith("%") else (eb, ea)
        if _sympy_equal(pct / 100, other):
            return True
    if not (ea.free_symbols or eb.free_symbols):
        xa, xb = _exact_value(ea), _exact_value(eb)
        if xa is not None and xb is not None:
            return xa == xb
        va, vb = _num(ea), _num(eb)
        if va is not None and vb is not None and (_rounds_to(a_, vb) or _rounds_to(b_, va)):
            return True
    return _sympy_equal(ea, eb)


# --------------------------------------------------------------------------- latex -> sympy

_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "ln", "log", "exp"}
_CONSTS = {"pi": "pi", "infty": "oo", "infinity": "oo"}
_MAX_EXPR_LEN = 300
_MAX_EXPONENT = 1000
_MAX_MAGNITUDE = 1e300


class _Unsupported(Exception):
    pass


def _read_group(s: str, i: int) -> tuple[str, int]:
    """Read one TeX argument at s[i]: ``{...}``, ``\\cmd`` or one character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise _Unsupported("missing argument")
    if s[i] == "{":
        close = _match_brace(s, i)
        if close < 0:
            raise _Unsupported("unbalanced")
        return s[i + 1 : close], close + 1
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+", s[i:])
        if m:
            return m.group(0), i + m.end()
        return s[i : i + 2], i + 2
    return s[i], i + 1


def _latex_to_py(s: str) -> str:
    out: list[str] = []
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+)", s[i:])
            if not m:
                if s[i : i + 2] in ("\\{", "\\}"):
                    raise _Unsupported("set braces")
                i += 2  # spacing like "\ "
                continue
            name = m.group(1)
            i += m.end()
            if name == "frac":
                num, i = _read_group(s, i)
                den, i = _read_group(s, i)
                out.append(f"(({_latex_to_py(num)})/({_latex_to_py(den)}))")
            elif name == "sqrt":
                root = None
                j = i
                while j < n and s[j] == " ":
                    j += 1
                if j < n and s[j] == "[":
                    k = s.find("]", j)
                    if k < 0:
                        raise _Unsupported("sqrt index")
                    root, i = s[j + 1 : k], k + 1
                arg, i = _read_group(s, i)
                if root is None:
                    out.append(f"sqrt({_latex_to_py(arg)})")
                else:
                    out.append(f"(({_latex_to_py(arg)})**(1/({_latex_to_py(root)})))")
            elif name in ("cdot", "times", "ast"):
                out.append("*")
            elif name == "div":
                out.append("/")
            elif name in _CONSTS:
                out.append(f" {_CONSTS[name]} ")
            elif name in _FUNCS:
                out.append(" log " if name == "ln" else f" {name} ")
            else:
                raise _Unsupported(f"\\{name}")
            continue
        if c == "^":
            arg, i = _read_group(s, i + 1)
            out.append(f"**({_latex_to_py(arg)})")
            continue
        if c == "_":
            arg, i = _read_group(s, i + 1)
            if not re.fullmatch(r"[A-Za-z0-9]+", arg):
                raise _Unsupported("subscript")
            out.append("_" + arg)
            continue
        if c == "{":
            out.append("(")
        elif c == "}":
            out.append(")")
        elif c == "[" or c == "]":
            raise _Unsupported("brackets")
        else:
            out.append(c)
        i += 1
    return "".join(out)


_SAFE_CHARS = re.compile(r"[0-9A-Za-z_+\-*/().\s]*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ALLOWED_NAMES = {"sqrt", "pi", "oo", "log", "exp", "E", "I"} | (_FUNCS - {"ln"})


_GLOBALS: Optional[dict] = None


def _sympy_globals() -> dict:
    """sympy's namespace for parse_expr, without Python builtins (input is whitelisted anyway)."""
    global _GLOBALS
    if _GLOBALS is None:
        ns: dict = {}
        exec("from sympy import *", ns)  # noqa: S102 - constant string
        ns["__builtins__"] = {}
        _GLOBALS = ns
    return dict(_GLOBALS)


def _to_sympy(s: str):
    """Guarded LaTeX -> sympy expression, or None when unsupported/unsafe."""
    if _load_sympy() is None or not s or len(s) > _MAX_EXPR_LEN:
        return None
    try:
        py = _latex_to_py(s)
    except (_Unsupported, RecursionError):
        return None
    if len(py) > 4 * _MAX_EXPR_LEN or not _SAFE_CHARS.fullmatch(py):
        return None
    if re.search(r"\.(?!\d)", py) or "__" in py or "!" in py:
        return None
    for ident in _IDENT.findall(py):
        if keyword.iskeyword(ident) or keyword.issoftkeyword(ident):
            return None
        if ident in _ALLOWED_NAMES:
            continue
        if not re.fullmatch(r"[A-Za-z](?:_[A-Za-z0-9]+)?", ident):
            # multi-letter run: only allow when it splits into single letters
            if not re.fullmatch(r"[A-Za-z]+", ident) or len(ident) > 4:
                return None
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    local = {
        "sqrt": _sympy.sqrt, "pi": _sympy.pi, "oo": _sympy.oo, "log": _sympy.log, "exp": _sympy.exp,
        "e": _sympy.E, "E": _sympy.E, "i": _sympy.I, "I": _sympy.I,
        "sin": _sympy.sin, "cos": _sympy.cos, "tan": _sympy.tan, "cot": _sympy.cot, "sec": _sympy.sec,
        "csc": _sympy.csc, "arcsin": _sympy.asin, "arccos": _sympy.acos, "arctan": _sympy.atan,
        "sinh": _sympy.sinh, "cosh": _sympy.cosh, "tanh": _sympy.tanh,
    }
    for ident in set(_IDENT.findall(py)):
        if ident not in local:
            if re.fullmatch(r"[A-Za-z](?:_[A-Za-z0-9]+)?", ident):
                local[ident] = _sympy.Symbol(ident)
            else:  # split multi-letter products like "xy"
                for ch in ident:
                    local.setdefault(ch, _sympy.Symbol(ch))
    try:
        expr = parse_expr(
            py,
            local_dict=local,
            global_dict=_sympy_globals(),
            transformations=standard_transformations + (implicit_multiplication_application,),
            evaluate=False,
        )
    except Exception:
        return None
    if not isinstance(expr, _sympy.Basic) or not _safe_powers(expr):
        return None
    return expr


def _safe_powers(expr) -> bool:
    for node in _sympy.postorder_traversal(expr):
        if isinstance(node, _sympy.Pow):
            exp_ = node.exp
            if exp_.free_symbols:
                continue
            try:
                v = complex(exp_.evalf(15))
            except Exception:
                return False
            if not math.isfinite(abs(v)) or abs(v) > _MAX_EXPONENT:
                return False
            if not node.free_symbols:
                # a constant power must stay a modest number ((2^999)^999 is refused)
                try:
                    mag = abs(complex(node.evalf(15)))
                except (TypeError, OverflowError, ValueError):
                    return False
                if not math.isfinite(mag) or mag > _MAX_MAGNITUDE:
                    return False
        elif isinstance(node, _sympy.Integer) and abs(int(node)) > 10**60:
            return False
    return True


def _num(expr) -> Optional[complex]:
    try:
        v = complex(_sympy.N(expr, 30))
    except Exception:
        return None
    if not (math.isfinite(v.real) and math.isfinite(v.imag)):
        return None
    return v


def _sympy_equal(a, b) -> bool:
    try:
        if a == b:
            return True
        syms = sorted(a.free_symbols | b.free_symbols, key=lambda x: x.name)
        if not syms:
            if a.has(_sympy.oo, _sympy.zoo) or b.has(_sympy.oo, _sympy.zoo):
                return bool(_sympy.simplify(a) == _sympy.simplify(b))
            va, vb = _num(a), _num(b)
            return va is not None and vb is not None and _close(va, vb)
        # symbolic: numeric probing at deterministic random points, then simplify
        rng = random.Random(1234)
        tol = 1e-6
        agree = 0
        for _ in range(5):
            point = {sym: rng.uniform(0.3, 2.7) for sym in syms}
            va, vb = _num(a.subs(point)), _num(b.subs(point))
            if va is None or vb is None:
                continue
            if abs(va - vb) > max(ABS_TOL, tol * max(abs(va), abs(vb))):
                return False
            agree += 1
        if agree >= 3:
            return True
        if _sympy.count_ops(a) + _sympy.count_ops(b) > 80:
            return False
        return _sympy.simplify(a - b) == 0
    except Exception:
        return False


# --------------------------------------------------------------------------- equivalence

_CHOICE_RE = re.compile(r"\(?\s*([A-Ea-e])\s*\)?[.:]?")


def _choice_letter(s: str) -> Optional[str]:
    m = _CHOICE_RE.fullmatch(s)
    return m.group(1).upper() if m else None


_ASSIGN_RE = re.compile(r"([A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?|[A-Za-z]\([A-Za-z]\))\s*(?:=|\\in)\s*(.+)")


def _strip_assignment(s: str) -> str:
    parts = _split_top(s)
    stripped = []
    for p in parts:
        m = _ASSIGN_RE.fullmatch(p.strip())
        if not m or "=" in m.group(2):
            return s
        stripped.append(m.group(2).strip())
    return ",".join(stripped)


def _is_wordy(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z ]*", s)) and len(s) > 1


def _equiv_norm(p: str, g: str) -> bool:
    if p == g:
        return True
    if not p or not g:
        return False
    if _is_wordy(p) and _is_wordy(g):
        return p.casefold() == g.casefold()
    lp, lg = _choice_letter(p), _choice_letter(g)
    if lp is not None or lg is not None:
        return lp is not None and lp == lg
    # equations: compare sides
    if p.count("=") == 1 and g.count("=") == 1:
        pl, pr = p.split("=")
        gl, gr = g.split("=")
        if _scalar_equiv(pl, gl) and _scalar_equiv(pr, gr):
            return True
    sp, sg = _structure(p), _structure(g)
    kp, kg = sp[0], sg[0]
    if kp == "scalar" and kg == "scalar":
        return _scalar_equiv(p, g)
    if kp == "union" and kg == "union":
        return _multiset_match(sp[1], sg[1])
    if kp == "seq" and kg == "seq":
        return (
            sp[1] == sg[1]
            and sp[2] == sg[2]
            and len(sp[3]) == len(sg[3])
            and all(_equiv_norm(x, y) for x, y in zip(sp[3], sg[3]))
        )
    if kp in ("set", "list") and kg in ("set", "list"):
        return _multiset_match(sp[1], sg[1])
    # bare list vs parenthesized tuple: ordered comparison
    for a, b in ((sp, sg), (sg, sp)):
        if a[0] == "list" and b[0] == "seq" and b[1] == "(" and b[2] == ")":
            return len(a[1]) == len(b[3]) and all(_equiv_norm(x, y) for x, y in zip(a[1], b[3]))
    return False


def is_equiv(pred: Any, gold: Any) -> bool:
    """Whether two final answers are mathematically the same (see module doc)."""
    if pred is None or gold is None:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if _equiv_norm(p, g):
        return True
    p2, g2 = _strip_assignment(p), _strip_assignment(g)
    if (p2, g2) != (p, g) and _equiv_norm(p2, g2):
        return True
    return False


def grade_answer(pred: Any, label: Any) -> bool:
    """``is_equiv`` against one label or any of a list/tuple of labels."""
    if isinstance(label, (list, tuple, set)):
        return any(is_equiv(pred, lab) for lab in label)
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        label = repr(label) if isinstance(label, float) else str(label)
    return is_equiv(pred, label)
