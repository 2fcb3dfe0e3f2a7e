"""The fuzzer of tests/test_fuzz_input.py: every bad input refused in one line, found by fuzzing the whole surface
rather than by a list.

Its modules: `surface` (what is enumerated, `Case`, the seed), `mutations` (the values a type is tried with),
`cases` (the cases of config keys, spec keys and options), `files` (the cases of every file or folder input)
and `oracle` (how a case runs and is judged: `Fuzzer`, `problem`, `file_problem`).

The surface is enumerated, not listed, so that a new key or option is fuzzed without editing this file:

- config keys: every field of `lab/config`'s `Config`, walked recursively (`suites.*` through one configured
  suite, picked by the seed among those the base run can evaluate, and evaluated in the case);
- spec keys: every field of `lab/sweep/spec_schema.py`'s `SweepSpec` and `ExperimentSpec` and of the dataclasses
  they hold (a space's parameter, an objective, the sampler, the pruner, an arm), mutated in a valid spec file;
- options: every verb of `lab.cli.build_parser()` (its subparsers, walked; `VERB worker` where a subparser
  sets `takes_worker`) and every action of each: its options, its positional arguments and its overrides;
- files and folders: every config key with a `path` rule (lab/config/rules.py `PathRule`), every argument whose type
  has one (lab/cli/common.py `path_type`) and every override a verb takes as a file (`named_files`: `sweep=PATH`), each
  given the paths of its kind (`file_inputs`: missing, empty, binary, truncated, of the other kind, under a
  file, a symlink loop, a model or checkpoint folder with the right names and the wrong contents; for an
  output, those that apply, a path not there yet being good) in a folder of its own outside the store.

Each gets the mutations its type admits: a wrong type; out of range (negative or zero, huge, not finite);
an unknown enum member; an empty list; a list with duplicates; for an option also a missing value, a malformed
one, and for the overrides malformed `key=value` words. Where a class has several values the seed picks one.
The cases are a fixed, seeded set: every key and option, and of the config keys' (key, class) pairs
`CONFIG_EXAMPLES` of them, at least one per key (`LAB_FUZZ_SEED` picks another set, `LAB_FUZZ_EXAMPLES=all`
runs every pair); `test_the_surface_is_covered` prints how many cases a run generates.

How a case is judged. It runs in process through `lab.cli.main`: the same parsing, composition, preflight,
store reachability and verb checks as the command. Every verb does its work only once all its checks have
passed; here the calls its work starts with (`WORK` in tests/test_fuzz_input.py) raise `Valid`, so a case that
passes validation stops there and counts as running correctly. That is how long work is skipped: no run, study,
target build, report, export or server is ever started (`test_every_verb_reaches_its_work` checks that `WORK`
names every verb and that each verb's base case gets there, so a verb missing from it fails that test instead
of starting work). Any other end must be exit code 2 and exactly one stderr line, `error: ...`, naming the key
or option (or the spec file) and saying what is expected; a traceback, another exit code or a second line
fails. A bad file case must end so (reaching its work fails it: its verb's work would start on it), a good one
must reach its work, and neither may
change anything in its folder (every file case runs; `LAB_FUZZ_FILES=N` runs a seeded N of them, every key
and option at least once; `test_every_file_input_is_fuzzed` prints how many). A seeded sample of failing cases
(and of failing file cases) runs again through the real `lab` command in subprocesses (exit 2, the same one
line). The recorded store
(tests/test_bad_input.py's `recorded` folder, plus a study to report on) must stay exactly as it was: its files
after every test, and its `snapshot` (runs, metrics, params, tags, artifacts, files) at the end.
"""
