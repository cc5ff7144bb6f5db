package access

import (
	"strings"
	"testing"
)

func TestEntriesAndVerify(t *testing.T) {
	h, err := HashPasswordIterations("pw", minIterations)
	if err != nil {
		t.Fatal(err)
	}
	entries := Entries(" alice:operator:"+h+" ,, ", "# team\n\nbob:viewer:"+h+"\n  carol:viewer:nohash\n", "/etc/users")
	if len(entries) != 3 || entries[0].Where != "CONSOLE_USERS entry 1" || entries[2].Where != "CONSOLE_USERS_FILE /etc/users line 4" {
		t.Fatalf("entries %+v", entries)
	}
	users, err := ParseUsers(entries)
	if len(users) != 2 || err == nil || !strings.Contains(err.Error(), "CONSOLE_USERS_FILE /etc/users line 4: user carol") {
		t.Fatalf("users %v, error %v", users, err)
	}
	for _, tt := range []struct {
		hash, password string
		ok             bool
	}{
		{h, "pw", true},
		{h, "PW", false},
		{strings.Replace(h, "$10000$", "$10001$", 1), "pw", false}, // other rounds, other key
		{"pbkdf2-sha256$10000$!!$xx", "pw", false},
		{"", "", false},
	} {
		if got := Verify(tt.hash, tt.password); got != tt.ok {
			t.Errorf("Verify(%.30q, %q) = %v, want %v", tt.hash, tt.password, got, tt.ok)
		}
	}
	if _, err := HashPassword(""); err == nil {
		t.Error("HashPassword accepts an empty password")
	}
}
