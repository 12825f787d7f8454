"""Everything that draws with Streamlit: the shared engine and sidebar (engine_access), the room
(room), the page entry guard (shell), test mode vs live (mode), and the sections pages share."""
