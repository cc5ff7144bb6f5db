package policy

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Classifier tells which error classes go straight to the parking lot. The
// zero value knows only "permanent".
type Classifier struct {
	patterns []string
}

// ParseClassifier parses NON_RETRIABLE_ERRORS: comma-separated glob patterns.
//
// A pattern matches the whole defer.error.class value; "*" matches any run
// of characters (dots and "$" included) and "?" exactly one; every other
// character stands for itself, case-sensitively. White space around an item
// is ignored; an empty item, or white space inside one, is an error. An
// empty spec classifies only "permanent" as non-retriable.
func ParseClassifier(spec string) (Classifier, error) {
	if strings.TrimSpace(spec) == "" {
		return Classifier{}, nil
	}
	var c Classifier
	start := 0 // 0-based offset of the current item
	for {
		end := strings.IndexByte(spec[start:], ',')
		last := end < 0
		if last {
			end = len(spec)
		} else {
			end += start
		}
		item := spec[start:end]
		lead := len(item) - len(strings.TrimLeft(item, " \t\n\r\v\f"))
		item = strings.TrimSpace(item)
		at := start + lead // where the trimmed item starts
		if item == "" {
			found := `","`
			if last {
				found = "the end of the input"
			}
			return Classifier{}, &SyntaxError{Pos: at + 1, Msg: fmt.Sprintf("expected an error class pattern, found %s (an empty item)", found)}
		}
		if i := strings.IndexAny(item, " \t\n\r\v\f"); i >= 0 {
			rest := strings.TrimLeft(item[i:], " \t\n\r\v\f")
			return Classifier{}, &SyntaxError{
				Pos: at + len(item) - len(rest) + 1,
				Msg: fmt.Sprintf("expected \",\" between error class patterns, found %q after %q", firstField(rest), item[:i]),
			}
		}
		c.patterns = append(c.patterns, item)
		if last {
			return c, nil
		}
		start = end + 1
	}
}

func firstField(s string) string {
	if f := strings.Fields(s); len(f) > 0 {
		return f[0]
	}
	return s
}

// Classify returns "" when errorClass may be retried, else the reason code
// ("permanent" or "non_retriable") and a detail for the stored reason.
// White space around errorClass is ignored; an empty class is retriable.
func (c Classifier) Classify(errorClass string) (code, detail string) {
	class := strings.TrimSpace(errorClass)
	if class == "" {
		return "", ""
	}
	if strings.EqualFold(class, "permanent") {
		return "permanent", fmt.Sprintf("defer.error.class %q", class)
	}
	for _, p := range c.patterns {
		if globMatch(p, class) {
			return "non_retriable", fmt.Sprintf("defer.error.class %q matches NON_RETRIABLE_ERRORS pattern %q", class, p)
		}
	}
	return "", ""
}

// String renders the patterns as NON_RETRIABLE_ERRORS would list them.
func (c Classifier) String() string { return strings.Join(c.patterns, ",") }

// globMatch reports whether s matches pattern, where "*" matches any run of
// characters and "?" exactly one (a UTF-8 sequence, or one byte of invalid
// UTF-8). It backtracks only to the last "*", so it runs in
// O(len(pattern)*len(s)) time whatever the input.
func globMatch(pattern, s string) bool {
	px, sx := 0, 0
	starPx, starSx := -1, 0 // where the last "*" is, and where its match ends
	for sx < len(s) {
		if px < len(pattern) {
			switch c := pattern[px]; c {
			case '*':
				starPx, starSx = px, sx
				px++
				continue
			case '?':
				_, n := utf8.DecodeRuneInString(s[sx:])
				px++
				sx += n
				continue
			default:
				if s[sx] == c {
					px++
					sx++
					continue
				}
			}
		}
		if starPx < 0 {
			return false
		}
		// Let the last "*" take one more character and retry from there.
		_, n := utf8.DecodeRuneInString(s[starSx:])
		starSx += n
		px, sx = starPx+1, starSx
	}
	for px < len(pattern) && pattern[px] == '*' {
		px++
	}
	return px == len(pattern)
}
