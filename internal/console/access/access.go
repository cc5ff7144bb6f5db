// Package access is who may use the operator console: its users, each with
// a role (viewer or operator) and a password hash, as CONSOLE_USERS and
// CONSOLE_USERS_FILE give them, and the password hashes themselves
// (PBKDF2-SHA256, as `scheduler console hash-password` prints them). It is
// a package of its own so that the configuration (internal/config) can check
// the users at start-up without depending on the console.
package access

import (
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// The roles a console user may have.
const (
	// Viewer sees every page and may change nothing.
	Viewer = "viewer"
	// Operator may also act: expedite, cancel, park, replay, fix, pause,
	// resume, limit.
	Operator = "operator"
)

// Iterations is how many PBKDF2 rounds HashPassword uses: OWASP's figure
// for PBKDF2-HMAC-SHA256 (2023), about a third of a second on a laptop core.
const Iterations = 600000

// minIterations refuses hashes too cheap to guess against, should one be
// written by hand.
const minIterations = 10000

const scheme = "pbkdf2-sha256"

// User is one console user.
type User struct {
	Name string
	Role string
	// Hash is the password hash, pbkdf2-sha256$<iterations>$<salt>$<key>.
	Hash string
}

// HashPassword returns the hash of password that CONSOLE_USERS takes:
// pbkdf2-sha256$<iterations>$<salt, base64>$<key, base64>, with a random
// 16-byte salt.
func HashPassword(password string) (string, error) {
	return HashPasswordIterations(password, Iterations)
}

// HashPasswordIterations is HashPassword with a given number of rounds;
// tests use few, to stay fast. Fewer than 10000 are refused by ParseUsers.
func HashPasswordIterations(password string, iterations int) (string, error) {
	if password == "" {
		return "", errors.New("the password is empty")
	}
	salt := make([]byte, 16)
	if _, err := rand.Read(salt); err != nil {
		return "", fmt.Errorf("read random salt: %w", err)
	}
	key, err := pbkdf2.Key(sha256.New, password, salt, iterations, sha256.Size)
	if err != nil {
		return "", fmt.Errorf("derive the key: %w", err)
	}
	enc := base64.RawStdEncoding
	return fmt.Sprintf("%s$%d$%s$%s", scheme, iterations, enc.EncodeToString(salt), enc.EncodeToString(key)), nil
}

// hash is a parsed password hash.
type hash struct {
	iterations int
	salt, key  []byte
}

func parseHash(s string) (hash, error) {
	parts := strings.Split(s, "$")
	if len(parts) != 4 || parts[0] != scheme {
		return hash{}, errors.New("not a hash of the form pbkdf2-sha256$<iterations>$<salt>$<key> (print one with `scheduler console hash-password`)")
	}
	n, err := strconv.Atoi(parts[1])
	if err != nil || n < minIterations || n > 100_000_000 {
		return hash{}, fmt.Errorf("iterations %q: want an integer %d..100000000", parts[1], minIterations)
	}
	enc := base64.RawStdEncoding
	salt, err := enc.DecodeString(strings.TrimRight(parts[2], "="))
	if err != nil || len(salt) < 8 {
		return hash{}, errors.New("the salt is not base64 of at least 8 bytes")
	}
	key, err := enc.DecodeString(strings.TrimRight(parts[3], "="))
	if err != nil || len(key) != sha256.Size {
		return hash{}, errors.New("the key is not base64 of 32 bytes")
	}
	return hash{iterations: n, salt: salt, key: key}, nil
}

// Verify reports whether password matches the hash h, in time that does not
// depend on how much of it matches. A malformed hash matches nothing.
func Verify(h, password string) bool {
	p, err := parseHash(h)
	if err != nil {
		return false
	}
	key, err := pbkdf2.Key(sha256.New, password, p.salt, p.iterations, len(p.key))
	if err != nil {
		return false
	}
	return subtle.ConstantTimeCompare(key, p.key) == 1
}

// ParseUsers reads users from entries of the form name:role:hash, as
// CONSOLE_USERS (comma-separated) and CONSOLE_USERS_FILE (one a line) give
// them; where names each entry in errors ("CONSOLE_USERS entry 2", ...).
// Blank entries and, in files, lines starting with # are skipped by the
// caller. Every problem is reported, none quotes a hash.
func ParseUsers(entries []Entry) ([]User, error) {
	var (
		users []User
		errs  []error
		seen  = map[string]string{}
	)
	for _, e := range entries {
		name, rest, ok1 := strings.Cut(e.Text, ":")
		role, h, ok2 := strings.Cut(rest, ":")
		name, role, h = strings.TrimSpace(name), strings.TrimSpace(role), strings.TrimSpace(h)
		switch {
		case !ok1 || !ok2:
			errs = append(errs, fmt.Errorf("%s: want name:role:hash, e.g. alice:operator:<hash from scheduler console hash-password>", e.Where))
			continue
		case !validName(name):
			errs = append(errs, fmt.Errorf("%s: user name %q: want 1-64 of [A-Za-z0-9._@-]", e.Where, name))
			continue
		case role != Viewer && role != Operator:
			errs = append(errs, fmt.Errorf("%s: user %s: role %q: want viewer or operator", e.Where, name, role))
			continue
		}
		if _, err := parseHash(h); err != nil {
			errs = append(errs, fmt.Errorf("%s: user %s: password hash (not shown): %w", e.Where, name, err))
			continue
		}
		if prev, dup := seen[name]; dup {
			errs = append(errs, fmt.Errorf("%s: user %s is already given by %s", e.Where, name, prev))
			continue
		}
		seen[name] = e.Where
		users = append(users, User{Name: name, Role: role, Hash: h})
	}
	return users, errors.Join(errs...)
}

// Entry is one name:role:hash entry and where it was given.
type Entry struct {
	Text  string
	Where string
}

// Entries splits CONSOLE_USERS (comma-separated) and the text of
// CONSOLE_USERS_FILE (one entry a line, # comments and blank lines
// skipped) into entries; file names the file in errors.
func Entries(users, fileText, file string) []Entry {
	var out []Entry
	for i, e := range strings.Split(users, ",") {
		if strings.TrimSpace(e) != "" {
			out = append(out, Entry{Text: e, Where: fmt.Sprintf("CONSOLE_USERS entry %d", i+1)})
		}
	}
	for i, line := range strings.Split(fileText, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out = append(out, Entry{Text: line, Where: fmt.Sprintf("CONSOLE_USERS_FILE %s line %d", file, i+1)})
	}
	return out
}

func validName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		ok := c == '.' || c == '_' || c == '@' || c == '-' || (c >= '0' && c <= '9') || (c|0x20 >= 'a' && c|0x20 <= 'z')
		if !ok {
			return false
		}
	}
	return true
}
