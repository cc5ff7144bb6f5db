-- deferred_message_header: a message's headers one per row, for queries
-- (deferred_message keeps them as two parallel arrays, header_keys and
-- header_values, so that order, duplicates and binary values survive).
--
-- CREATE OR REPLACE VIEW keeps the view's grants, but can only add columns
-- at the end: to drop, rename or retype one, drop the view in a numbered
-- migration (which re-applies this file after it).

CREATE OR REPLACE VIEW deferred_message_header AS
SELECT m.id, h.position, h.key, h.value
FROM deferred_message m,
     unnest(m.header_keys, m.header_values) WITH ORDINALITY AS h (key, value, position);
