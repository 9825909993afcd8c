"""tools/check_py_imports.py over this workspace's Python sources (every package's py_sources in
the runfiles) finds nothing; and on small trees written here, it finds each kind of problem it
exists for (so that a clean result means something)."""

import os
import tempfile
import textwrap
import unittest

import check_py_imports


def problems(files):
    """The errors of check_py_imports over a tree of {path: source}."""
    with tempfile.TemporaryDirectory() as tree:
        for path, source in files.items():
            os.makedirs(os.path.join(tree, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(tree, path), "w") as f:
                f.write(textwrap.dedent(source))
        g = check_py_imports.Graph(tree)
        check_py_imports.check_cycles(g)
        check_py_imports.check_private(g)
        check_py_imports.check_sys_path(g)
        return g.errors


PACKAGE = {
    "lib/pkg/__init__.py": "from pkg.low import helper\n",
    "lib/pkg/low.py": "def helper():\n    pass\n\n\ndef _private():\n    pass\n",
    "lib/pkg/high.py": "from pkg.low import helper\n",
}


class WorkspaceTest(unittest.TestCase):
    def test_the_workspace_is_clean(self):
        tree = check_py_imports.default_tree()
        g = check_py_imports.Graph(tree)
        self.assertGreater(len(g.modules), 50, f"too few Python files under {tree}")
        check_py_imports.check_cycles(g)
        check_py_imports.check_private(g)
        check_py_imports.check_sys_path(g)
        self.assertEqual(g.errors, [], "\n".join(g.errors))


class RulesTest(unittest.TestCase):
    def test_a_clean_tree(self):
        self.assertEqual(problems(PACKAGE), [])

    def test_other_libraries_private_parts_are_theirs(self):
        self.assertEqual(problems({**PACKAGE, "tests/t.py": "import torch._C\n"
                                   "from vllm.x import _y\n"}), [])

    def test_a_cycle_hidden_in_a_function(self):
        errors = problems({**PACKAGE, "lib/pkg/low.py":
                           "def helper():\n    from pkg.high import x\n    return x\n"})
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("import cycle between lib/pkg/high.py, lib/pkg/low.py", errors[0])

    def test_a_cycle_under_type_checking(self):
        errors = problems({**PACKAGE, "lib/pkg/low.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.high import Thing
            def helper():
                pass
            """})
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("import cycle", errors[0])

    def test_a_cycle_between_top_level_modules(self):
        errors = problems({"a/one.py": "import two\n", "a/two.py": "import one\n"})
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("a/one.py:1 imports a/two.py", errors[0])

    def test_a_package_importing_its_own_modules_is_no_cycle(self):
        self.assertEqual(problems({**PACKAGE, "lib/pkg/high.py": "import pkg\n"}), [])

    def test_a_private_name_from_another_module(self):
        errors = problems({**PACKAGE, "lib/pkg/high.py": "from pkg.low import _private\n"})
        self.assertEqual(errors, ["lib/pkg/high.py:1: imports _private from pkg.low, private "
                                  "to it"])

    def test_a_private_module_from_outside_its_package(self):
        errors = problems({**PACKAGE, "tests/t.py": "from pkg._gen import x\n",
                           "lib/pkg/inner.py": "from pkg._gen import x\n"})
        self.assertEqual(errors, ["tests/t.py:1: imports pkg._gen, private to pkg"])

    def test_two_modules_of_one_name(self):
        self.assertEqual(problems({**PACKAGE, "a/util.py": "", "b/util.py": ""}), [])
        errors = problems({**PACKAGE, "a/util.py": "", "b/util.py": "",
                           "c/user.py": "import util\n"})
        self.assertEqual(errors, ["two first-party modules named util: a/util.py, b/util.py"])

    def test_sys_path_edits(self):
        errors = problems({
            **PACKAGE,
            "lib/pkg/low.py": "import sys\nsys.path.insert(0, 'x')\n",
            "bin/once.py": "import sys\nsys.path.insert(0, 'x')\n"
                           "if __name__ == '__main__':\n    pass\n",
            "bin/twice.py": "import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\n"
                            "if __name__ == '__main__':\n    pass\n",
            "bin/late.py": "import sys\ndef main():\n    sys.path[:0] = ['x']\n"
                           "if __name__ == '__main__':\n    main()\n",
            "bin/imported.py": "import sys\nsys.path.insert(0, 'x')\n"
                               "if __name__ == '__main__':\n    pass\n",
            "bin/user.py": "import imported\n",
        })
        self.assertEqual(sorted(e.split(": edits")[0] for e in errors),
                         ["bin/imported.py:2", "bin/late.py:3", "bin/twice.py:2",
                          "bin/twice.py:3", "lib/pkg/low.py:2"], "\n".join(errors))


if __name__ == "__main__":
    unittest.main()
