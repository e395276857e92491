"""The C layers of csrc/ (docs/ARCHITECTURE.md, "C (`csrc/`), in layers") as the includes show them.

Each layer offers its own header; a file includes only headers of its own layer or of layers below,
and pyccl.h, which every header includes, declares no function of the project.  Reads the sources
only: no build, no GPU."""
import os
import re

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CSRC = os.path.join(_REPO, "csrc")

# The table of docs/ARCHITECTURE.md, top layer first: every file of csrc/ (headers included) in its
# layer.  A file may include headers of its own layer and of the layers after it.
LAYERS = [
    ("module", ["module.c"]),
    ("bindings", ["python_nccl.c"]),
    ("methods", ["comm_ops.c", "comm_ops.h", "comm_p2p.c", "comm_split.c", "registration.c",
                 "registration.h"]),
    ("memory", ["memory.c", "memory.h"]),
    ("type", ["communicator.c", "clique.c", "communicator.h"]),
    ("registrations", ["reg_list.c", "reg_list.h"]),
    ("own kernels", ["ar.c", "ar_setup.c", "ar_region.c", "ar_load.c", "ar.h", "ar_setup.h",
                     "ar_load.h", "kernels/allreduce.cu", "kernels/ar_abi.h"]),
    ("the door", ["call.c", "call.h"]),
    ("timeouts", ["watchdog.c", "watch_fail.c", "watch_state.c", "watch_calls.c", "watch_enqueue.c", "watch_life.c",
                  "watch_costs.c",
                  "timeouts.h", "watch.h"]),
    ("enqueue", ["enqueue.c", "enqueue.h"]),
    ("shared pieces", ["tensor.c", "tensor.h", "loader.c", "loader.h", "args.c", "args.h",
                       "errors.c", "errors.h", "locks.c", "locks.h", "pyccl.h"]),
]
LAYER_OF = {f: i for i, (_, files) in enumerate(LAYERS) for f in files}

# Includes that go up a layer, each with its reason.  The test fails on any other, and on one of
# these once it is gone (strike it here then).
UPWARD = {}


def _csrc_files():
    """Every C, CUDA and header file under csrc/, as a path relative to it ("kernels/ar_abi.h")."""
    out = []
    for root, _, names in os.walk(_CSRC):
        for name in names:
            if name.endswith((".c", ".h", ".cu")):
                out.append(os.path.relpath(os.path.join(root, name), _CSRC).replace(os.sep, "/"))
    return sorted(out)


def _read(rel):
    with open(os.path.join(_CSRC, rel), encoding="utf-8") as f:
        return f.read()


def _includes(rel):
    """The project headers `rel` includes ("..." form), as paths relative to csrc/."""
    here = os.path.dirname(rel)
    return [os.path.normpath(os.path.join(here, inc)).replace(os.sep, "/")
            for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', _read(rel), re.M)]


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _without_inline_definitions(text):
    """text with every `static inline` function (signature and body) cut out."""
    out, pos = [], 0
    for m in re.finditer(r"\bstatic\s+inline\b", text):
        if m.start() < pos:
            continue
        body = text.index("{", m.end())
        depth, i = 0, body
        while True:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        out.append(text[pos:m.start()])
        pos = i + 1
    out.append(text[pos:])
    return "".join(out)


def test_every_csrc_file_is_in_the_layer_table():
    files = set(_csrc_files())
    listed = set(LAYER_OF)
    assert sorted(files - listed) == [], "files of csrc/ missing from LAYERS"
    assert sorted(listed - files) == [], "LAYERS names files csrc/ does not have"


def test_includes_go_down_the_layers():
    upward, unknown = {}, []
    for rel in _csrc_files():
        if rel not in LAYER_OF:
            continue
        for inc in _includes(rel):
            if inc not in LAYER_OF:
                unknown.append(f"{rel} includes {inc}")
            elif LAYER_OF[inc] < LAYER_OF[rel]:
                upward[(rel, inc)] = (f"{rel} ({LAYERS[LAYER_OF[rel]][0]}) includes {inc} "
                                      f"({LAYERS[LAYER_OF[inc]][0]})")
    assert unknown == []
    assert sorted(v for k, v in upward.items() if k not in UPWARD) == []
    assert sorted(k for k in UPWARD if k not in upward) == [], "gone: strike them from UPWARD"


def test_pyccl_h_declares_no_project_function():
    text = _without_inline_definitions(_strip_comments(_read("pyccl.h")))
    functions = sorted(set(re.findall(r"\b(pyccl_\w+)\s*\(", text)))
    assert functions == [], "declared in pyccl.h: belongs in the header of the layer defining it"
    data = sorted(set(re.findall(r"\bextern\b[^;(]*?\b(pyccl_\w+)\s*[\[;]", text)))
    assert data == [], "declared in pyccl.h: belongs in the header of the file defining it"


def _docs_table():
    with open(os.path.join(_REPO, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## C (`csrc/`), in layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        # files and header columns
        names = re.findall(r"`([\w./]+\.(?:c|h|cu))`", cells[1] + " " + cells[2])
        rows.append((cells[0], sorted(set(names))))
    return rows


def test_architecture_table_lists_the_same_layers_and_files():
    ours = [(name, sorted(files)) for name, files in LAYERS]
    assert _docs_table() == ours



# The module state, pyccl.h's pyccl_state: what every layer shares (exception and heap types, the
# NCCL/CUDA table, `exiting`) and one pointer to each layer's own part.  A new member belongs in the
# part of the layer that uses it, unless every layer does.
STATE_MAX_MEMBERS = 14
# Each part: its member in pyccl_state -> (its struct, the one file that defines it).  The file's
# layer owns the part: only files of that layer reach it (`st->part`), and its members can be named
# only where the definition is seen (a .c file, or a header of that layer that only the layer
# includes); elsewhere the type is incomplete and the compiler refuses them.
STATE_PARTS = {
    "torch": ("pyccl_torch", "tensor.c"),
    "redops": ("pyccl_redops", "args.c"),
    "libs": ("pyccl_libs", "loader.c"),
    "cliques": ("pyccl_cliques", "clique.c"),
    "comms": ("pyccl_comms", "communicator.c"),
    "watchdog": ("pyccl_watchdog", "watch.h"),
}


def _state_members():
    """pyccl_state's members as (declaration, name) pairs, from pyccl.h."""
    text = _strip_comments(_read("pyccl.h"))
    m = re.search(r"typedef\s+struct\s*\{([^{}]*)\}\s*pyccl_state\s*;", text)
    assert m, "pyccl.h: no `typedef struct {...} pyccl_state;` (members without nested braces)"
    members = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        # `PyObject *a, *b;` declares two members
        head, *more = decl.split(",")
        for part in [head] + more:
            name = re.search(r"(\w+)\s*(?:\[[^\]]*\])*\s*$", part)
            assert name, f"pyccl_state: cannot read the member in {decl!r}"
            members.append((decl, name.group(1)))
    return members


def test_module_state_holds_only_what_every_layer_shares():
    members = _state_members()
    assert len(members) <= STATE_MAX_MEMBERS, (
        f"pyccl_state has {len(members)} members (at most {STATE_MAX_MEMBERS}): "
        "put a layer's own state in its part")
    parts = {name: re.match(r"struct\s+(\w+)\s*\*", decl).group(1)
             for decl, name in members if re.match(r"struct\s+pyccl_\w+\s*\*", decl)}
    assert parts == {name: struct for name, (struct, _) in STATE_PARTS.items()}


def test_every_state_pointer_is_named_st():
    """The next test finds the parts reached as `st->part`: every pyccl_state pointer is `st`."""
    other = []
    for rel in _csrc_files():
        text = _strip_comments(_read(rel))
        for m in re.finditer(r"\bpyccl_state\s*\*\s*(?:const\s+)?(\w+)\s*(\(?)", text):
            if not m.group(2) and m.group(1) != "st":  # `(`: a function returning one
                other.append(f"{rel}: pyccl_state *{m.group(1)}")
    assert other == []


def test_state_parts_stay_in_their_layer():
    defined, reached, seen = {}, [], []
    for rel in _csrc_files():
        text = _strip_comments(_read(rel))
        for part, (struct, owner) in STATE_PARTS.items():
            if re.search(r"\bstruct\s+%s\s*\{" % struct, text):
                defined.setdefault(part, []).append(rel)
            if LAYER_OF.get(rel) != LAYER_OF[owner] and re.search(r"\bst\s*->\s*%s\b" % part, text):
                reached.append(f"{rel} ({LAYERS[LAYER_OF[rel]][0]}) reaches st->{part}")
            if owner.endswith(".h") and owner in _includes(rel) and LAYER_OF[rel] != LAYER_OF[owner]:
                seen.append(f"{rel} includes {owner}, which defines struct {struct}")
    assert defined == {part: [owner] for part, (_, owner) in STATE_PARTS.items()}
    assert reached == []
    assert seen == []
