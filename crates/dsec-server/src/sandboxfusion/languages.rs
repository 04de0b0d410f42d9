//! SandboxFusion's languages and, for each, the source file it writes and the compile and
//! run commands it gives `bash` (`sandbox/runners/major.py` and `minor.py`), kept as they
//! are so that a program behaves as it did there. Where Debian lacks SandboxFusion's tool
//! the grader image provides one under the same name (`dmd` is LDC's `ldmd2`, `tsx`
//! strips types with Debian's TypeScript) or, for C#, the recipe uses Mono.

use rand::Rng;

/// Defines [`Language`] from the names of SandboxFusion's `Language` literal, in its order:
/// each variant is named as its value is spelled.
macro_rules! languages {
    ($($name:ident),* $(,)?) => {
        /// The `language` field's values, all of SandboxFusion's `Language` literal.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        pub(crate) enum Language {
            $($name),*
        }

        impl Language {
            /// In SandboxFusion's order.
            pub(crate) const ALL: &[Language] = &[$(Language::$name),*];

            pub(crate) fn as_str(self) -> &'static str {
                match self {
                    $(Language::$name => stringify!($name)),*
                }
            }
        }
    };
}

languages!(
    python,
    cpp,
    nodejs,
    go,
    go_test,
    java,
    php,
    csharp,
    bash,
    typescript,
    sql,
    rust,
    cuda,
    lua,
    R,
    perl,
    D_ut,
    ruby,
    scala,
    julia,
    pytest,
    junit,
    kotlin_script,
    jest,
    verilog,
    python_gpu,
    lean,
    swift,
    racket,
);

impl Language {
    pub(crate) fn parse(name: &str) -> Option<Language> {
        Language::ALL.iter().copied().find(|l| l.as_str() == name)
    }

    /// The programs its commands run, besides `bash`: they must be on the image's `PATH`.
    pub(crate) fn needs(self) -> &'static [&'static str] {
        use Language::*;
        match self {
            python => &["python"],
            pytest => &["pytest"],
            cpp => &["g++"],
            go | go_test => &["go"],
            java | junit => &["javac", "java"],
            nodejs => &["node"],
            typescript => &["tsx"],
            jest => &["npm"],
            php => &["php"],
            rust => &["rustc"],
            csharp => &["mcs", "mono"],
            lua => &["lua"],
            R => &["Rscript"],
            perl => &["perl"],
            D_ut => &["dmd"],
            ruby => &["ruby"],
            scala => &["scalac", "scala"],
            julia => &["julia"],
            kotlin_script => &["kotlin"],
            verilog => &["iverilog", "vvp"],
            lean => &["lake"],
            swift => &["swiftc"],
            racket => &["racket"],
            bash | sql | cuda | python_gpu => &[],
        }
    }

    /// The request's working directory: the grader image prepares it with the files
    /// SandboxFusion copies into its temporary directory for the language (`go.mod`,
    /// the Java jars); for others it is created with the source file.
    pub(crate) fn workdir(self) -> String {
        format!("/tmp/sandbox/{}", self.as_str())
    }
}

/// What one request runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Absolute path of the source file, and its contents (`None`: no file, as for an
    /// empty JUnit request).
    pub source: Option<(String, String)>,
    /// The compile step's `bash` command line, if the language has one.
    pub compile: Option<String>,
    /// The run step's `bash` command line.
    pub run: String,
}

/// Why a language cannot be run at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Neither SandboxFusion nor dsec has a runner for it.
    NoRunner,
    /// It needs a GPU; fncall workers have none.
    NeedsGpu,
    /// SandboxFusion's own check failed before running anything (Scala without an
    /// `object`): a compile result of status `Error` with this text.
    CompileError(&'static str),
}

/// Facts about the image that change a recipe.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ImageFacts {
    /// `libssl` and `libcrypto` can be linked: SandboxFusion then adds `-lcrypto -lssl`.
    pub openssl: bool,
}

/// SandboxFusion's temporary file name: `tmp` and 8 random characters.
fn temp_name(suffix: &str) -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789_";
    let mut rng = rand::rng();
    let random: String = (0..8)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect();
    format!("tmp{random}{suffix}")
}

/// The plan for `code` in `language`; `file_names` are the request's `files` keys (Java
/// puts the jars among them on its class path).
pub(crate) fn plan(
    language: Language,
    code: &str,
    file_names: &[&str],
    facts: ImageFacts,
) -> Result<Plan, Refusal> {
    use Language::*;
    let dir = language.workdir();
    let at = |name: String| format!("{dir}/{name}");
    let temp = |suffix: &str| at(temp_name(suffix));
    let jars = |base: &[&str]| {
        base.iter()
            .copied()
            .chain(file_names.iter().copied().filter(|f| f.ends_with(".jar")))
            .collect::<Vec<_>>()
            .join(":")
    };
    // A program run by an interpreter: `RUNNER FILE`.
    let script = |suffix: &str, runner: &str| {
        let f = temp(suffix);
        let run = format!("{runner} {f}");
        (f, None, run)
    };
    // A program compiled by `BEFORE FILE AFTER`, then run by `run`.
    let compiled = |suffix: &str, before: &str, after: &str, run: &str| {
        let f = temp(suffix);
        let compile = format!("{before}{f}{after}");
        (f, Some(compile), run.to_owned())
    };
    let (source, compile, run): (String, Option<String>, String) = match language {
        python => script(".py", "python"),
        pytest => script(".py", "pytest"),
        cpp => {
            let flags = match facts.openssl {
                true => " -o test -lcrypto -lssl -lpthread",
                false => " -o test -lpthread",
            };
            compiled(".cpp", "g++ -std=c++17 ", flags, "./test")
        }
        go => compiled(".go", "go build -o out ", "", "./out"),
        go_test => script("_test.go", "go test"),
        java => {
            let cp = jars(&[".", "javatuples-1.2.jar"]);
            (
                at("Main.java".into()),
                Some(format!("javac -cp {cp} Main.java")),
                format!("java -cp {cp} -ea Main"),
            )
        }
        junit => {
            const RUNNER: &str = "junit-platform-console-standalone-1.8.2.jar";
            let cp = jars(&[".", RUNNER, "junit-jupiter-api-5.11.0-javadoc.jar"]);
            let class = java_public_class(code).unwrap_or("Main");
            let source = at(format!("{class}.java"));
            let compile = format!("javac -cp {cp} *.java");
            let run = format!("java -jar ./{RUNNER} --class-path {cp} --scan-class-path");
            if code.is_empty() {
                return Ok(Plan {
                    source: None,
                    compile: Some(compile),
                    run,
                });
            }
            (source, Some(compile), run)
        }
        nodejs => script(".js", "node"),
        typescript => script(".ts", "tsx"),
        jest => (temp(".test.ts"), None, "npm run test".into()),
        php => script(".php", "php -f"),
        rust => compiled(".rs", "rustc ", " -o test", "./test"),
        bash => script(".sh", "/bin/bash"),
        // SandboxFusion runs `dotnet run`, which builds and runs in one step; Debian has
        // Mono instead. The compiler's own output goes to stderr, as dotnet keeps it
        // out of the program's stdout.
        csharp => (
            at("Program.cs".into()),
            None,
            "mcs -nologo -out:Program.exe Program.cs 1>&2 && mono Program.exe".into(),
        ),
        lua => script(".lua", "lua"),
        R => script(".R", "Rscript"),
        perl => script(".pl", "perl"),
        D_ut => compiled(".d", "dmd ", " -unittest -of=test", "./test"),
        ruby => script(".rb", "ruby"),
        scala => {
            let Some(object) = scala_object(code) else {
                return Err(Refusal::CompileError("Object name not found."));
            };
            let f = temp(".scala");
            let compile = format!("scalac {f}");
            (f, Some(compile), format!("scala {object}"))
        }
        julia => script(".jl", "julia"),
        kotlin_script => script(".kts", "kotlin"),
        verilog => compiled(
            ".sv",
            "iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o test.vvp ",
            ";",
            "vvp -n test.vvp",
        ),
        lean => (at("Main.lean".into()), None, "lake build".into()),
        swift => compiled(".swift", "swiftc ", " -o test.out", "./test.out"),
        racket => script(".rkt", "racket"),
        cuda | python_gpu => return Err(Refusal::NeedsGpu),
        sql => return Err(Refusal::NoRunner),
    };
    let code = match language {
        php => php_with_tag(code),
        _ => code.to_owned(),
    };
    Ok(Plan {
        source: Some((source, code)),
        compile,
        run,
    })
}

/// SandboxFusion's `ensure_php_tag_in_string`: leading blanks dropped, `<?php` added when
/// missing.
fn php_with_tag(code: &str) -> String {
    let code = code.trim_start();
    if code.starts_with("<?php") {
        code.to_owned()
    } else {
        format!("<?php\n{code}")
    }
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Skips whitespace from `i`; the position after it and whether there was any.
fn skip_space(s: &[u8], i: usize) -> (usize, bool) {
    let end = s[i..]
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map_or(s.len(), |n| i + n);
    (end, end > i)
}

/// Reads a word from `i`: its end, if there is one.
fn word(s: &[u8], i: usize) -> Option<usize> {
    let end = s[i..]
        .iter()
        .position(|b| !is_word(*b))
        .map_or(s.len(), |n| i + n);
    (end > i).then_some(end)
}

/// `keyword` at `i` followed by whitespace: the position after the whitespace.
fn keyword_then_space(s: &[u8], i: usize, keyword: &str) -> Option<usize> {
    let k = keyword.as_bytes();
    if !s[i..].starts_with(k) {
        return None;
    }
    match skip_space(s, i + k.len()) {
        (end, true) => Some(end),
        _ => None,
    }
}

/// SandboxFusion's `find_java_public_class_name`: the first match of
/// `\bpublic\s+(abstract\s+|final\s+)?class\s+(\w+)`.
pub(crate) fn java_public_class(code: &str) -> Option<&str> {
    let s = code.as_bytes();
    (0..s.len()).find_map(|i| {
        if i > 0 && is_word(s[i - 1]) {
            return None;
        }
        let mut j = keyword_then_space(s, i, "public")?;
        for modifier in ["abstract", "final"] {
            if let Some(k) = keyword_then_space(s, j, modifier) {
                j = k;
                break;
            }
        }
        let j = keyword_then_space(s, j, "class")?;
        word(s, j).map(|end| &code[j..end])
    })
}

/// SandboxFusion's `find_scala_classname`: the first match of
/// `object\s+(\w+)(\s*)|(\s+extends\s+\w+\s*){`, whose object name is empty (not found)
/// when the second alternative matches first.
pub(crate) fn scala_object(code: &str) -> Option<&str> {
    let s = code.as_bytes();
    for i in 0..s.len() {
        if let Some(j) = keyword_then_space(s, i, "object") {
            if let Some(end) = word(s, j) {
                return Some(&code[j..end]);
            }
        }
        let (j, spaced) = skip_space(s, i);
        if !spaced {
            continue;
        }
        let Some(j) = keyword_then_space(s, j, "extends") else {
            continue;
        };
        let Some(j) = word(s, j) else {
            continue;
        };
        if s.get(skip_space(s, j).0) == Some(&b'{') {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_sandboxfusions() {
        let p = plan(Language::python, "print(1)", &[], ImageFacts::default()).unwrap();
        let (path, code) = p.source.clone().unwrap();
        assert!(path.starts_with("/tmp/sandbox/python/tmp") && path.ends_with(".py"));
        assert_eq!(code, "print(1)");
        assert_eq!(p.run, format!("python {path}"));
        assert_eq!(p.compile, None);

        let facts = ImageFacts { openssl: true };
        let p = plan(Language::cpp, "int main(){}", &[], facts).unwrap();
        let path = p.source.unwrap().0;
        assert_eq!(
            p.compile.unwrap(),
            format!("g++ -std=c++17 {path} -o test -lcrypto -lssl -lpthread")
        );
        assert_eq!(p.run, "./test");

        let p = plan(Language::java, "", &["lib/x.jar", "a.txt"], facts).unwrap();
        assert_eq!(p.source.unwrap().0, "/tmp/sandbox/java/Main.java");
        assert_eq!(
            p.compile.unwrap(),
            "javac -cp .:javatuples-1.2.jar:lib/x.jar Main.java"
        );
        assert_eq!(p.run, "java -cp .:javatuples-1.2.jar:lib/x.jar -ea Main");
    }

    #[test]
    fn php_gets_its_tag_once() {
        assert_eq!(php_with_tag("  echo 1;"), "<?php\necho 1;");
        assert_eq!(php_with_tag("\n<?php echo 1;"), "<?php echo 1;");
    }

    #[test]
    fn java_public_class_as_sandboxfusion_finds_it() {
        assert_eq!(java_public_class("public class Foo {}"), Some("Foo"));
        assert_eq!(
            java_public_class("class A {}\npublic final  class B_2 extends A {}"),
            Some("B_2")
        );
        assert_eq!(java_public_class("notpublic class X {}"), None);
        assert_eq!(java_public_class("class Main {}"), None);
        let p = plan(
            Language::junit,
            "public class MyTest {}",
            &[],
            ImageFacts::default(),
        );
        assert_eq!(
            p.unwrap().source.unwrap().0,
            "/tmp/sandbox/junit/MyTest.java"
        );
        assert_eq!(
            plan(Language::junit, "", &[], ImageFacts::default())
                .unwrap()
                .source,
            None
        );
    }

    #[test]
    fn scala_object_as_sandboxfusion_finds_it() {
        assert_eq!(scala_object("object Main extends App {}"), Some("Main"));
        assert_eq!(scala_object("// x\nobject  Hello {\n}"), Some("Hello"));
        assert_eq!(scala_object("class A extends B {}\nobject Main"), None);
        assert_eq!(scala_object("def f = 1"), None);
        assert_eq!(
            plan(Language::scala, "val x = 1", &[], ImageFacts::default()),
            Err(Refusal::CompileError("Object name not found."))
        );
    }

    #[test]
    fn every_language_has_a_name_and_a_plan_or_a_reason() {
        for &lang in Language::ALL {
            assert_eq!(Language::parse(lang.as_str()), Some(lang));
            let _ = plan(lang, "object X", &[], ImageFacts::default());
        }
        assert_eq!(Language::parse("js"), None);
    }
}
