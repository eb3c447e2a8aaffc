"""Runs the ```python blocks of one README section in one interpreter, like the cells of a notebook (used by
tests/project/test_readme.py; not a test module).

Reads one JSON object per line on stdin, {"label": ..., "path": file holding the block's code}, executes the code in
a namespace shared by all blocks of this process, and answers on stdout with one JSON line {"ok": bool, "error":
traceback or null}. What the blocks print goes to stderr, so it cannot be mistaken for an answer. As in an
interactive session, the working directory comes first on sys.path (not this file's folder), and nothing of the
project is imported here: a block that needs `modeling_memoryformer` imports it itself, as a reader would.
"""

import json
import sys
import traceback


def main() -> None:
    sys.path[0] = ""  # the working directory, as for `python -c` or the REPL
    answers = sys.stdout
    sys.stdout = sys.stderr  # the blocks' own output
    namespace = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        print(f"----- {request['label']} -----", flush=True)
        with open(request["path"], encoding="utf-8") as f:
            code = compile(f.read(), request["path"], "exec")
        try:
            exec(code, namespace)  # README code, by design
            answer = {"ok": True, "error": None}
        except BaseException:  # a SystemExit from a block is a failure too
            answer = {"ok": False, "error": traceback.format_exc()}
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
